"""Gemma 3's vision tower: a SigLIP ViT encoder and the multimodal projector into the LM.

`VisionEncoder` turns images float32[I, H, W, C] (channels last, already resized and normalised
by `image_processor.py`) into patch features [I, P*P, Dv]: a stride-`patch_size` patch embedding
(a convolution written as one contraction), learned position embeddings, `num_layers` pre-norm
blocks of bidirectional multi-head attention and a GELU MLP (LayerNorms and linear layers all
with biases), and a final LayerNorm. SigLIP's attention-pooling head is not used by Gemma 3 and
is not implemented.

`MultiModalProjector` average-pools the P x P patch grid down to `mm_tokens_per_image` soft tokens,
applies Gemma's (1 + w) RMSNorm and projects to the language model's width D.

The attention layout matches the decoder's (q/k/v [Dv, N, H], o [N, H, Dv]) so the LoRA wrapper
of `lora.py` applies unchanged; `apply_vision_lora` wraps the vision attention projections.

Sharding: the tower's weights carry the decoder's logical axes, its width Dv as "embed" (FSDP
shards it), heads and the MLP width as "heads" / "mlp" (tensor parallelism splits them); its
bias and norm vectors are replicated. The projector's output width is the language model's
"embed" (its input width Dv stays whole, since an array uses a mesh axis at most once).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from nonstop.models.config import ConfigError
from nonstop.models.layers import RMSNorm, _param
from nonstop.models.lora import LoRAConfig, LoRAWeight, project
from nonstop.models.quantize import weight_value
from nonstop.models.validation import check

VISION_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# transformers' SiglipVisionConfig defaults.
_SIGLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "image_size": 224, "patch_size": 16, "num_channels": 3,
    "layer_norm_eps": 1e-6,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """Architecture of a SigLIP vision encoder (Hugging Face `siglip_vision_model`)."""

    hidden_size: int  # Dv
    intermediate_size: int  # Fv
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        owner = "VisionConfig"
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "image_size",
                     "patch_size", "num_channels"):
            check(getattr(self, name) > 0, owner, name, getattr(self, name), "an int >= 1")
        check(self.image_size % self.patch_size == 0, owner, "image_size", self.image_size,
              f"a multiple of patch_size={self.patch_size}")
        check(self.hidden_size % self.num_heads == 0, owner, "hidden_size", self.hidden_size,
              f"a multiple of num_heads={self.num_heads}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, source: str = "<dict>") -> VisionConfig:
        """Read the `vision_config` of a Gemma 3 `config.json`; refuse what we do not implement."""
        def need(key: str, expected: Any, meaning: str) -> None:
            if key in hf and hf[key] != expected:
                raise ConfigError(f"{source}: vision_config field {key!r} = {hf[key]!r}: "
                                  f"{meaning} is not supported (need {expected!r})")

        hf = {**_SIGLIP_DEFAULTS, **hf}  # released configs leave default fields out
        need("model_type", "siglip_vision_model", "a vision tower other than SigLIP")
        need("hidden_act", "gelu_pytorch_tanh", "this activation")
        need("vision_use_head", False, "SigLIP's attention-pooling head")
        need("attention_dropout", 0.0, "attention dropout")
        try:
            return cls(hidden_size=int(hf["hidden_size"]),
                       intermediate_size=int(hf["intermediate_size"]),
                       num_layers=int(hf["num_hidden_layers"]),
                       num_heads=int(hf["num_attention_heads"]),
                       image_size=int(hf["image_size"]), patch_size=int(hf["patch_size"]),
                       num_channels=int(hf.get("num_channels", 3)),
                       layer_norm_eps=float(hf.get("layer_norm_eps", 1e-6)))
        except KeyError as e:
            raise ConfigError(f"{source}: vision_config field {e.args[0]!r} is missing") from None

    def to_hf(self) -> dict[str, Any]:
        return {"model_type": "siglip_vision_model", "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "image_size": self.image_size, "patch_size": self.patch_size,
                "num_channels": self.num_channels, "layer_norm_eps": self.layer_norm_eps,
                "hidden_act": "gelu_pytorch_tanh", "attention_dropout": 0.0,
                "vision_use_head": False}


class LayerNorm(nnx.Module):
    """(x - mean) / std * w + b, statistics in float32."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32)
                + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def _bias(shape: tuple[int, ...], axes: tuple[str | None, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


class VisionAttention(nnx.Module):
    """Bidirectional multi-head attention with biases on every projection."""

    def __init__(self, cfg: VisionConfig, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        D, N, H = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.q_proj = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), param_dtype)
        self.k_proj = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), param_dtype)
        self.v_proj = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), param_dtype)
        self.o_proj = _param(rngs, (N, H, D), ("heads", "head_dim", "embed"), param_dtype)
        self.q_bias = _bias((N, H), ("heads", "head_dim"), param_dtype)
        self.k_bias = _bias((N, H), ("heads", "head_dim"), param_dtype)
        self.v_bias = _bias((N, H), ("heads", "head_dim"), param_dtype)
        self.o_bias = _bias((D,), (None,), param_dtype)
        self.scale = H**-0.5

    def __call__(self, x: Array) -> Array:
        dt = x.dtype
        q = project(x, self.q_proj, 1) + self.q_bias[...].astype(dt)  # [I, P, N, H]
        k = project(x, self.k_proj, 1) + self.k_bias[...].astype(dt)
        v = project(x, self.v_proj, 1) + self.v_bias[...].astype(dt)
        scores = jnp.einsum("iqnh,iknh->inqk", q, k).astype(jnp.float32) * self.scale
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        out = jnp.einsum("inqk,iknh->iqnh", probs, v)
        return project(out, self.o_proj, 2) + self.o_bias[...].astype(dt)


class VisionMLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.fc1 = _param(rngs, (D, F), ("embed", "mlp"), param_dtype)
        self.fc1_bias = _bias((F,), ("mlp",), param_dtype)
        self.fc2 = _param(rngs, (F, D), ("mlp", "embed"), param_dtype)
        self.fc2_bias = _bias((D,), (None,), param_dtype)

    def __call__(self, x: Array) -> Array:
        dt = x.dtype
        h = jax.nn.gelu(project(x, self.fc1, 1) + self.fc1_bias[...].astype(dt), approximate=True)
        return project(h, self.fc2, 1) + self.fc2_bias[...].astype(dt)


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.norm1 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, param_dtype=param_dtype)
        self.attn = VisionAttention(cfg, param_dtype=param_dtype, rngs=rngs)
        self.norm2 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, param_dtype=param_dtype)
        self.mlp = VisionMLP(cfg, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionEncoder(nnx.Module):
    """SigLIP: images float32[I, H, W, C] -> patch features [I, P*P, Dv] (row-major patches)."""

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32,
                 param_dtype: jnp.dtype = jnp.float32):
        P, C, D = cfg.patch_size, cfg.num_channels, cfg.hidden_size
        self.cfg = cfg
        self.dtype = dtype
        self.patch_embed = _param(rngs, (P, P, C, D), (None, None, None, "embed"),
                                  param_dtype)
        self.patch_bias = _bias((D,), (None,), param_dtype)
        self.pos_embed = _param(rngs, (cfg.patches_per_side**2, D), (None, "embed"),
                                param_dtype)
        self.layers = nnx.List([VisionBlock(cfg, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.post_norm = LayerNorm(D, eps=cfg.layer_norm_eps, param_dtype=param_dtype)

    def __call__(self, images: Array) -> Array:
        cfg = self.cfg
        I, H, W, C = images.shape
        if (H, W, C) != (cfg.image_size, cfg.image_size, cfg.num_channels):
            raise ValueError(f"images must be [I, {cfg.image_size}, {cfg.image_size}, "
                             f"{cfg.num_channels}] (run them through ImageProcessor), got "
                             f"{list(images.shape)}")
        P, S = cfg.patch_size, cfg.patches_per_side
        patches = images.astype(self.dtype).reshape(I, S, P, S, P, C).transpose(0, 1, 3, 2, 4, 5)
        x = jnp.tensordot(patches, self.patch_embed[...].astype(self.dtype), axes=3)
        x = x.reshape(I, S * S, cfg.hidden_size) + self.patch_bias[...].astype(self.dtype)
        x = x + self.pos_embed[...].astype(self.dtype)
        for block in self.layers:
            x = block(x)
        return self.post_norm(x)


class MultiModalProjector(nnx.Module):
    """Patch features [I, P*P, Dv] -> soft tokens [I, M, D]: average pool, RMSNorm, project."""

    def __init__(self, cfg: VisionConfig, *, text_hidden_size: int, tokens_per_image: int,
                 rngs: nnx.Rngs, param_dtype: jnp.dtype = jnp.float32):
        side = round(tokens_per_image**0.5)
        if side * side != tokens_per_image or cfg.patches_per_side % side:
            raise ConfigError(f"mm_tokens_per_image ({tokens_per_image}) must be a square whose "
                              f"side divides the patch grid side ({cfg.patches_per_side})")
        self.tokens_per_side = side
        self.patches_per_side = cfg.patches_per_side
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, plus_one=True,
                            param_dtype=param_dtype)
        self.proj = _param(rngs, (cfg.hidden_size, text_hidden_size), (None, "embed"),
                           param_dtype)

    def __call__(self, features: Array) -> Array:
        I, _, Dv = features.shape
        S, t = self.patches_per_side, self.tokens_per_side
        k = S // t
        grid = features.reshape(I, t, k, t, k, Dv)
        pooled = jnp.mean(grid.astype(jnp.float32), axis=(2, 4)).astype(features.dtype)
        normed = self.norm(pooled.reshape(I, t * t, Dv))
        return project(normed, self.proj, 1)


def apply_vision_lora(encoder: VisionEncoder, cfg: LoRAConfig, *, seed: int = 0
                      ) -> VisionEncoder:
    """Wrap the vision attention projections named in `cfg.targets` with LoRA (in place)."""
    unsupported = set(cfg.targets) - set(VISION_LORA_TARGETS)
    if unsupported:
        raise ValueError(f"vision LoRA targets {sorted(unsupported)} are not vision projections; "
                         f"choose from {VISION_LORA_TARGETS}")
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    for block in encoder.layers:
        for name in cfg.targets:
            base = getattr(block.attn, name)
            if isinstance(base, LoRAWeight):
                raise TypeError(f"vision {name} already has a LoRA adapter; merge it first")
            n_in = 2 if name == "o_proj" else 1
            setattr(block.attn, name, LoRAWeight(base, n_in=n_in, cfg=cfg, rngs=rngs))
    return encoder


def merge_vision_lora(encoder: VisionEncoder) -> VisionEncoder:
    """Fold the vision adapters into plain weights W + (alpha/r)·A·B (in place)."""
    for block in encoder.layers:
        for name in VISION_LORA_TARGETS:
            weight = getattr(block.attn, name)
            if isinstance(weight, LoRAWeight):
                base = weight.base
                merged = weight_value(base, jnp.float32) + weight.delta(jnp.float32)
                setattr(block.attn, name, nnx.Param(merged.astype(base[...].dtype),
                                                    logical_axes=base.logical_axes))
    return encoder


__all__ = ["LayerNorm", "MultiModalProjector", "VisionConfig", "VisionEncoder",
           "apply_vision_lora", "merge_vision_lora"]
