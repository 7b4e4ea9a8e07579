"""Where a run's model and tokenizer come from, and the two functions that build them.

    tokenizer = build_tokenizer(TokenizerSource(kind="char"), ModelSource(family="qwen3"))
    model = build_model(ModelSource(family="qwen3", num_layers=3), tokenizer, seed=0)

A model is a local Hugging Face checkpoint (`path`), a named preset with random weights
(`preset`), or a tiny `ModelConfig.tiny(family)` with random weights whose sizes the source
overrides. A tokenizer is a local tokenizer directory (default: the model's checkpoint) or
nonstop's built-in character tokenizer. Every run config (`nonstop sft`, `rl`, `agentic`) holds
these two sources; nothing else builds a model from a config.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
from jax.sharding import Mesh

from nonstop.models.char_tokenizer import char_tokenizer
from nonstop.models.chat_templates import CHAT_FORMATS, ChatFormat
from nonstop.models.checkpoint import load_pretrained
from nonstop.models.config import Family, ModelConfig
from nonstop.models.decoder import Decoder, init_decoder
from nonstop.models.tokenizer import Tokenizer
from nonstop.models.validation import ConfigError, check, check_choice

TokenizerKind = Literal["pretrained", "char"]
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
          "num_kv_heads", "head_dim", "max_position_embeddings")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSource:
    """Where the weights come from: a local Hugging Face checkpoint (`path`), a named preset with
    random weights (`preset`), or, with neither, a tiny `ModelConfig.tiny(family)` with random
    weights whose sizes the fields below override (`vocab_size` None: the tokenizer's)."""

    path: str | None = None
    preset: str | None = None
    family: Family = "llama"
    vocab_size: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int | None = None
    tie_embeddings: bool | None = None

    def __post_init__(self) -> None:
        check(self.path is None or self.preset is None, "ModelSource", "preset", self.preset,
              f"null while path={self.path!r} is set (path: a checkpoint, preset: random "
              "weights; set one, not both)")
        check_choice("ModelSource", "family", self.family, Family)
        for name in _SIZES:
            value = getattr(self, name)
            check(value is None or value >= 1, "ModelSource", name, value, "an int >= 1 or null")

    @property
    def kind(self) -> Literal["checkpoint", "preset", "tiny"]:
        if self.path is not None:
            return "checkpoint"
        return "preset" if self.preset is not None else "tiny"

    def tiny_overrides(self) -> dict[str, int | bool]:
        """The sizes set here, as `ModelConfig` fields."""
        names = (*_SIZES, "tie_embeddings")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerSource:
    """`pretrained`: a local tokenizer directory (`path`, default the model's checkpoint).
    `char`: nonstop's built-in character tokenizer with `chat_format`'s special tokens."""

    kind: TokenizerKind = "pretrained"
    path: str | None = None
    chat_format: ChatFormat = "qwen"

    def __post_init__(self) -> None:
        check_choice("TokenizerSource", "kind", self.kind, TokenizerKind)
        check_choice("TokenizerSource", "chat_format", self.chat_format, CHAT_FORMATS)


def build_tokenizer(source: TokenizerSource, model: ModelSource) -> Tokenizer:
    """The char tokenizer, or a local tokenizer directory (default: the model checkpoint's)."""
    if source.kind == "char":
        return char_tokenizer(source.chat_format)
    path = source.path or model.path
    if path is None:
        raise ConfigError("tokenizer.kind=pretrained needs tokenizer.path or model.path; set one, "
                          "or tokenizer.kind=char for the built-in character tokenizer")
    return Tokenizer.from_pretrained(path)


def model_config(source: ModelSource, tokenizer: Tokenizer) -> ModelConfig:
    """The architecture of a randomly initialised model (preset, or tiny sized to `tokenizer`)."""
    if source.kind == "preset":
        return ModelConfig.preset(source.preset).replace(**source.tiny_overrides())
    special = dict(bos_token_id=tokenizer.bos_id, eos_token_ids=tokenizer.eos_ids,
                   pad_token_id=tokenizer.pad_id)
    return ModelConfig.tiny(source.family, **{"vocab_size": tokenizer.vocab_size, **special,
                                              **source.tiny_overrides()})


def build_model(source: ModelSource, tokenizer: Tokenizer, *, seed: int = 0,
                dtype: jnp.dtype = jnp.float32, param_dtype: jnp.dtype = jnp.float32,
                mesh: Mesh | None = None) -> Decoder:
    """A local checkpoint (placed on `mesh` tensor by tensor), or a preset / tiny config with
    random weights from `seed`; refused if its vocabulary is smaller than the tokenizer's."""
    if source.kind == "checkpoint":
        model = load_pretrained(source.path, dtype=dtype, param_dtype=param_dtype, mesh=mesh)
    else:
        model = init_decoder(model_config(source, tokenizer), seed=seed, dtype=dtype,
                             param_dtype=param_dtype)
    if model.cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's embedding table only "
            f"{model.cfg.vocab_size}; use the checkpoint's own tokenizer"
        )
    return model


__all__ = ["ModelSource", "TokenizerKind", "TokenizerSource", "build_model", "build_tokenizer",
           "model_config"]
