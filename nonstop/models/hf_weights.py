"""The correspondence between Hugging Face tensor names/layouts and our parameter paths.

Hugging Face linear weights are [out, in]; ours are einsum layouts ([D, N, H] for q, [N, H, D]
for o, [D, F] for gate/up, ...). Each `WeightSpec` knows both names, the Hugging Face shape,
and how to convert a host array each way, so loading and saving are table-driven.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from nonstop.models.config import ModelConfig

Path = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightSpec:
    hf_name: str
    path: Path
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _identity(a: np.ndarray) -> np.ndarray:
    return a


def _linear(out_dims: tuple[int, ...], in_dim: int) -> tuple[Callable, Callable]:
    """HF [prod(out), in] <-> ours [in, *out]."""
    def to_ours(a: np.ndarray) -> np.ndarray:
        return np.moveaxis(a.reshape(*out_dims, in_dim), -1, 0)

    def to_hf(a: np.ndarray) -> np.ndarray:
        return np.moveaxis(a, 0, -1).reshape(int(np.prod(out_dims)), in_dim)

    return to_ours, to_hf


def _out_proj(in_dims: tuple[int, ...], out_dim: int) -> tuple[Callable, Callable]:
    """HF [out, prod(in)] <-> ours [*in, out]."""

    def to_ours(a: np.ndarray) -> np.ndarray:
        return np.moveaxis(a.reshape(out_dim, *in_dims), 0, -1)

    def to_hf(a: np.ndarray) -> np.ndarray:
        return np.moveaxis(a, -1, 0).reshape(out_dim, int(np.prod(in_dims)))

    return to_ours, to_hf


def _reshape(shape_ours: tuple[int, ...], shape_hf: tuple[int, ...]) -> tuple[Callable, Callable]:
    return (lambda a: a.reshape(shape_ours)), (lambda a: a.reshape(shape_hf))


def weight_specs(cfg: ModelConfig, prefix: str = "model.") -> list[WeightSpec]:
    """Every tensor of a `*ForCausalLM` checkpoint for this config, in file order."""
    D, F, N, K, H, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                        cfg.head_dim, cfg.vocab_size)
    specs: list[WeightSpec] = []

    def add(hf_name: str, path: Path, hf_shape: tuple[int, ...],
            convert: tuple[Callable, Callable] = (_identity, _identity)) -> None:
        specs.append(WeightSpec(hf_name=hf_name, path=path, hf_shape=hf_shape,
                                to_ours=convert[0], to_hf=convert[1]))

    add(f"{prefix}embed_tokens.weight", ("embed",), (V, D))
    for i in range(cfg.num_layers):
        p, ours = f"{prefix}layers.{i}.", ("layers", i)
        add(p + "self_attn.q_proj.weight", ours + ("attn", "q_proj"), (N * H, D), _linear((N, H), D))
        add(p + "self_attn.k_proj.weight", ours + ("attn", "k_proj"), (K * H, D), _linear((K, H), D))
        add(p + "self_attn.v_proj.weight", ours + ("attn", "v_proj"), (K * H, D), _linear((K, H), D))
        add(p + "self_attn.o_proj.weight", ours + ("attn", "o_proj"), (D, N * H),
            _out_proj((N, H), D))
        if cfg.attention_bias:
            add(p + "self_attn.q_proj.bias", ours + ("attn", "q_bias"), (N * H,),
                _reshape((N, H), (N * H,)))
            add(p + "self_attn.k_proj.bias", ours + ("attn", "k_bias"), (K * H,),
                _reshape((K, H), (K * H,)))
            add(p + "self_attn.v_proj.bias", ours + ("attn", "v_bias"), (K * H,),
                _reshape((K, H), (K * H,)))
        if cfg.qk_norm:
            add(p + "self_attn.q_norm.weight", ours + ("attn", "q_norm", "scale"), (H,))
            add(p + "self_attn.k_norm.weight", ours + ("attn", "k_norm", "scale"), (H,))
        add(p + "mlp.gate_proj.weight", ours + ("mlp", "gate_proj"), (F, D), _linear((F,), D))
        add(p + "mlp.up_proj.weight", ours + ("mlp", "up_proj"), (F, D), _linear((F,), D))
        add(p + "mlp.down_proj.weight", ours + ("mlp", "down_proj"), (D, F), _linear((D,), F))
        add(p + "input_layernorm.weight", ours + ("input_norm", "scale"), (D,))
        if cfg.post_norms:  # Gemma 2/3 naming: post_attention_layernorm is a post-norm there
            add(p + "post_attention_layernorm.weight", ours + ("post_attn_norm", "scale"), (D,))
            add(p + "pre_feedforward_layernorm.weight", ours + ("pre_mlp_norm", "scale"), (D,))
            add(p + "post_feedforward_layernorm.weight", ours + ("post_mlp_norm", "scale"), (D,))
        else:
            add(p + "post_attention_layernorm.weight", ours + ("pre_mlp_norm", "scale"), (D,))
    add(f"{prefix}norm.weight", ("norm", "scale"), (D,))
    if not cfg.tie_embeddings:
        add("lm_head.weight", ("lm_head",), (V, D), _linear((V,), D))
    return specs


# Tensors some checkpoints carry that hold no weights of ours.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
