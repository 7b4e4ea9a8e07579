"""Model configuration: one frozen dataclass whose switches cover Llama, Qwen and Gemma decoders.

`ModelConfig` describes the architecture only (no dtypes, no training settings). Families differ
by the switches they set; `from_hf` reads a Hugging Face `config.json` (transformers 4.x and 5.x
layouts) and refuses any field value we do not implement rather than silently ignoring it.
Named presets for released checkpoints live in `presets.py`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal, get_args

from nonstop.models.validation import ConfigError, check, check_choice

Family = Literal["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]
Activation = Literal["silu", "gelu_tanh", "gelu"]
LayerType = Literal["full", "sliding"]
RopeKind = Literal["default", "linear", "llama3"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding frequencies: base `theta` plus an optional context-extension scaling."""

    theta: float = 10_000.0
    kind: RopeKind = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        check_choice("RopeConfig", "kind", self.kind, RopeKind)
        check(self.theta > 0, "RopeConfig", "theta", self.theta, "a number > 0")
        check(self.factor > 0, "RopeConfig", "factor", self.factor, "a number > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Llama / Qwen2 / Qwen3 / Gemma 1-3 text)."""

    family: Family
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    # Gemma 3 gives sliding-window layers their own RoPE base (no scaling).
    local_rope: RopeConfig | None = None
    attention_bias: bool = False  # Qwen2: bias on q, k, v
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + w)
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(D)
    activation: Activation = "silu"
    post_norms: bool = False  # Gemma 2/3: extra norms after attention and after the MLP
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 when set
    sliding_window: int | None = None
    layer_types: tuple[LayerType, ...] = ()  # empty means all "full"
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        owner = "ModelConfig"
        check_choice(owner, "family", self.family, Family)
        check_choice(owner, "activation", self.activation, Activation)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            check(getattr(self, name) > 0, owner, name, getattr(self, name), "an int >= 1")
        check(self.num_heads % self.num_kv_heads == 0, owner, "num_kv_heads", self.num_kv_heads,
              f"a divisor of num_heads={self.num_heads}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        layer_types = get_args(LayerType)
        check(len(self.layer_types) == self.num_layers
              and all(t in layer_types for t in self.layer_types), owner, "layer_types",
              self.layer_types, f"num_layers={self.num_layers} entries, each one of "
              + ", ".join(map(repr, layer_types)) + " (empty: all 'full')")
        check("sliding" not in self.layer_types or bool(self.sliding_window), owner,
              "sliding_window", self.sliding_window,
              "a window length >= 1, since layer_types has 'sliding' layers")

    @property
    def attention_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return float(base) ** -0.5

    def rope_for(self, layer_type: LayerType) -> RopeConfig:
        if layer_type == "sliding" and self.local_rope is not None:
            return self.local_rope
        return self.rope

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embeddings included once when tied)."""
        D, F, N, K, H, V = (self.hidden_size, self.intermediate_size, self.num_heads,
                            self.num_kv_heads, self.head_dim, self.vocab_size)
        attn = D * N * H * 2 + D * K * H * 2 + (N * H + 2 * K * H if self.attention_bias else 0)
        attn += 2 * H if self.qk_norm else 0
        norms = (4 if self.post_norms else 2) * D
        per_layer = attn + 3 * D * F + norms
        return V * D * (1 if self.tie_embeddings else 2) + self.num_layers * per_layer + D

    # ---- Hugging Face config.json ------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: str | Path | dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face `config.json` (a path, a directory holding one, or its dict)."""
        from nonstop.models.hf_config import config_from_hf

        source = "<dict>"
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.exists():
                raise ConfigError(f"{path}: no config.json found")
            source = str(path)
            config = json.loads(path.read_text())
        return config_from_hf(config, source=source)

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict transformers loads for this architecture."""
        from nonstop.models.hf_config import config_to_hf

        return config_to_hf(self)

    # ---- named presets (see presets.py) --------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        from nonstop.models.presets import PRESETS

        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
        return PRESETS[name]()

    @classmethod
    def llama3_1_8b(cls) -> ModelConfig:
        return cls.preset("llama3_1_8b")

    @classmethod
    def llama3_2_1b(cls) -> ModelConfig:
        return cls.preset("llama3_2_1b")

    @classmethod
    def llama3_2_3b(cls) -> ModelConfig:
        return cls.preset("llama3_2_3b")

    @classmethod
    def qwen2_5_0_5b(cls) -> ModelConfig:
        return cls.preset("qwen2_5_0_5b")

    @classmethod
    def qwen2_5_1_5b(cls) -> ModelConfig:
        return cls.preset("qwen2_5_1_5b")

    @classmethod
    def qwen2_5_7b(cls) -> ModelConfig:
        return cls.preset("qwen2_5_7b")

    @classmethod
    def qwen3_0_6b(cls) -> ModelConfig:
        return cls.preset("qwen3_0_6b")

    @classmethod
    def qwen3_1_7b(cls) -> ModelConfig:
        return cls.preset("qwen3_1_7b")

    @classmethod
    def qwen3_4b(cls) -> ModelConfig:
        return cls.preset("qwen3_4b")

    @classmethod
    def qwen3_8b(cls) -> ModelConfig:
        return cls.preset("qwen3_8b")

    @classmethod
    def gemma_2b(cls) -> ModelConfig:
        return cls.preset("gemma_2b")

    @classmethod
    def gemma_7b(cls) -> ModelConfig:
        return cls.preset("gemma_7b")

    @classmethod
    def gemma2_2b(cls) -> ModelConfig:
        return cls.preset("gemma2_2b")

    @classmethod
    def gemma2_9b(cls) -> ModelConfig:
        return cls.preset("gemma2_9b")

    @classmethod
    def gemma3_1b(cls) -> ModelConfig:
        return cls.preset("gemma3_1b")

    @classmethod
    def gemma3_4b(cls) -> ModelConfig:
        return cls.preset("gemma3_4b")

    @classmethod
    def gemma3_12b(cls) -> ModelConfig:
        return cls.preset("gemma3_12b")

    @classmethod
    def gemma3_27b(cls) -> ModelConfig:
        return cls.preset("gemma3_27b")

    @classmethod
    def tiny(cls, family: Family = "llama", **overrides: Any) -> ModelConfig:
        """A tiny config of the given family for tests and demos (prime-sized where it can be)."""
        from nonstop.models.presets import tiny_config

        return tiny_config(family, **overrides)
