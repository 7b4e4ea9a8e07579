"""Named presets for released checkpoints, and the per-family architecture switches.

The numbers are those of the checkpoints' own `config.json` files. A preset describes the
architecture only; weights always come from a local directory through `load_pretrained`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nonstop.models.config import Family, LayerType, ModelConfig, RopeConfig


def family_switches(family: Family) -> dict[str, Any]:
    """The switches that distinguish one family from Llama; the rest of the config is sizes."""
    gemma_common = dict(norm_plus_one=True, scale_embeddings=True, activation="gelu_tanh",
                        tie_embeddings=True)
    return {
        "llama": dict(),
        "qwen2": dict(attention_bias=True),
        "qwen3": dict(qk_norm=True),
        "gemma": dict(gemma_common),
        "gemma2": dict(gemma_common, post_norms=True),
        "gemma3": dict(gemma_common, post_norms=True, qk_norm=True),
    }[family]


def gemma2_layer_types(num_layers: int) -> tuple[LayerType, ...]:
    """Gemma 2 alternates: even layers slide, odd layers attend globally."""
    return tuple("sliding" if (i + 1) % 2 else "full" for i in range(num_layers))


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[LayerType, ...]:
    """Gemma 3: five sliding layers then one global layer, repeated."""
    return tuple("sliding" if (i + 1) % pattern else "full" for i in range(num_layers))


def _cfg(family: Family, **fields: Any) -> ModelConfig:
    return ModelConfig(family=family, **{**family_switches(family), **fields})


def _llama3(**sizes: Any) -> ModelConfig:
    factor = sizes.pop("rope_factor")
    return _cfg(
        "llama", vocab_size=128_256, rms_norm_eps=1e-5, max_position_embeddings=131_072,
        rope=RopeConfig(theta=500_000.0, kind="llama3", factor=factor, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=8192),
        bos_token_id=128_000, eos_token_ids=(128_001, 128_008, 128_009), **sizes,
    )


def _qwen2_5(**sizes: Any) -> ModelConfig:
    return _cfg("qwen2", rms_norm_eps=1e-6, max_position_embeddings=32_768,
                rope=RopeConfig(theta=1_000_000.0), eos_token_ids=(151_645, 151_643),
                pad_token_id=151_643, **sizes)


def _qwen3(**sizes: Any) -> ModelConfig:
    return _cfg("qwen3", vocab_size=151_936, rms_norm_eps=1e-6, max_position_embeddings=40_960,
                head_dim=128, rope=RopeConfig(theta=1_000_000.0), eos_token_ids=(151_645, 151_643),
                pad_token_id=151_643, **sizes)


def _gemma(**sizes: Any) -> ModelConfig:
    return _cfg("gemma", vocab_size=256_000, head_dim=256, rms_norm_eps=1e-6,
                bos_token_id=2, eos_token_ids=(1,), pad_token_id=0, **sizes)


def _gemma2(**sizes: Any) -> ModelConfig:
    layers = sizes["num_layers"]
    return _cfg("gemma2", vocab_size=256_000, head_dim=256, rms_norm_eps=1e-6,
                query_pre_attn_scalar=256.0, sliding_window=4096, attn_softcap=50.0,
                final_softcap=30.0, layer_types=gemma2_layer_types(layers), bos_token_id=2,
                eos_token_ids=(1, 107), pad_token_id=0, **sizes)


def _gemma3(**sizes: Any) -> ModelConfig:
    layers = sizes["num_layers"]
    factor = sizes.pop("rope_factor", 1.0)
    rope = RopeConfig(theta=1_000_000.0, kind="linear" if factor != 1.0 else "default",
                      factor=factor)
    fields = dict(head_dim=256, rms_norm_eps=1e-6, query_pre_attn_scalar=256.0,
                  sliding_window=1024, max_position_embeddings=131_072, vocab_size=262_208,
                  rope=rope, local_rope=RopeConfig(theta=10_000.0),
                  layer_types=gemma3_layer_types(layers), bos_token_id=2,
                  eos_token_ids=(1, 106), pad_token_id=0)
    return _cfg("gemma3", **{**fields, **sizes})


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "llama3_1_8b": lambda: _llama3(hidden_size=4096, intermediate_size=14_336, num_layers=32,
                                   num_heads=32, num_kv_heads=8, head_dim=128, rope_factor=8.0),
    "llama3_2_1b": lambda: _llama3(hidden_size=2048, intermediate_size=8192, num_layers=16,
                                   num_heads=32, num_kv_heads=8, head_dim=64, rope_factor=32.0,
                                   tie_embeddings=True),
    "llama3_2_3b": lambda: _llama3(hidden_size=3072, intermediate_size=8192, num_layers=28,
                                   num_heads=24, num_kv_heads=8, head_dim=128, rope_factor=32.0,
                                   tie_embeddings=True),
    "qwen2_5_0_5b": lambda: _qwen2_5(vocab_size=151_936, hidden_size=896, intermediate_size=4864,
                                     num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                                     tie_embeddings=True),
    "qwen2_5_1_5b": lambda: _qwen2_5(vocab_size=151_936, hidden_size=1536, intermediate_size=8960,
                                     num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                                     tie_embeddings=True),
    "qwen2_5_7b": lambda: _qwen2_5(vocab_size=152_064, hidden_size=3584, intermediate_size=18_944,
                                   num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128),
    "qwen3_0_6b": lambda: _qwen3(hidden_size=1024, intermediate_size=3072, num_layers=28,
                                 num_heads=16, num_kv_heads=8, tie_embeddings=True),
    "qwen3_1_7b": lambda: _qwen3(hidden_size=2048, intermediate_size=6144, num_layers=28,
                                 num_heads=16, num_kv_heads=8, tie_embeddings=True),
    "qwen3_4b": lambda: _qwen3(hidden_size=2560, intermediate_size=9728, num_layers=36,
                               num_heads=32, num_kv_heads=8, tie_embeddings=True),
    "qwen3_8b": lambda: _qwen3(hidden_size=4096, intermediate_size=12_288, num_layers=36,
                               num_heads=32, num_kv_heads=8),
    "gemma_2b": lambda: _gemma(hidden_size=2048, intermediate_size=16_384, num_layers=18,
                               num_heads=8, num_kv_heads=1),
    "gemma_7b": lambda: _gemma(hidden_size=3072, intermediate_size=24_576, num_layers=28,
                               num_heads=16, num_kv_heads=16),
    "gemma2_2b": lambda: _gemma2(hidden_size=2304, intermediate_size=9216, num_layers=26,
                                 num_heads=8, num_kv_heads=4),
    "gemma2_9b": lambda: _gemma2(hidden_size=3584, intermediate_size=14_336, num_layers=42,
                                 num_heads=16, num_kv_heads=8),
    "gemma3_1b": lambda: _gemma3(vocab_size=262_144, hidden_size=1152, intermediate_size=6912,
                                 num_layers=26, num_heads=4, num_kv_heads=1, sliding_window=512,
                                 max_position_embeddings=32_768),
    "gemma3_4b": lambda: _gemma3(hidden_size=2560, intermediate_size=10_240, num_layers=34,
                                 num_heads=8, num_kv_heads=4, rope_factor=8.0),
    "gemma3_12b": lambda: _gemma3(hidden_size=3840, intermediate_size=15_360, num_layers=48,
                                  num_heads=16, num_kv_heads=8, rope_factor=8.0),
    "gemma3_27b": lambda: _gemma3(hidden_size=5376, intermediate_size=21_504, num_layers=62,
                                  num_heads=32, num_kv_heads=16, head_dim=128,
                                  query_pre_attn_scalar=168.0, rope_factor=8.0),
}


def tiny_config(family: Family = "llama", **overrides: Any) -> ModelConfig:
    """A tiny config: prime vocab and MLP widths, and D != N * H, so shape bugs cannot hide.

    D = 44 rather than a prime because transformers' Llama validator insists D % N == 0.
    """
    num_layers = overrides.get("num_layers", 2)
    fields: dict[str, Any] = dict(
        vocab_size=257, hidden_size=44, intermediate_size=53, num_layers=num_layers, num_heads=4,
        num_kv_heads=2, head_dim=8, max_position_embeddings=512, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10_000.0), bos_token_id=1, eos_token_ids=(2,), pad_token_id=0,
    )
    if family == "llama":
        fields["rope"] = RopeConfig(theta=500_000.0, kind="llama3", factor=8.0,
                                    low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=64)
    if family in ("gemma2", "gemma3"):
        fields.update(query_pre_attn_scalar=11.0, sliding_window=5)
        pattern = gemma2_layer_types if family == "gemma2" else gemma3_layer_types
        fields["layer_types"] = pattern(num_layers)
    if family == "gemma2":
        fields.update(attn_softcap=50.0, final_softcap=30.0)
    if family == "gemma3":
        fields.update(local_rope=RopeConfig(theta=10_000.0),
                      rope=RopeConfig(theta=1_000_000.0, kind="linear", factor=8.0))
    fields.update(family_switches(family))
    fields.update(overrides)
    if "num_layers" in overrides and "layer_types" not in overrides and family in ("gemma2", "gemma3"):
        pattern = gemma2_layer_types if family == "gemma2" else gemma3_layer_types
        fields["layer_types"] = pattern(overrides["num_layers"])
    return ModelConfig(family=family, **fields)
