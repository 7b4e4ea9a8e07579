"""Weight-only quantization for QLoRA: int8 per output channel, or NF4 in blocks of 64.

A `QuantizedWeight` replaces a projection's `nnx.Param`; it is dequantized to the compute dtype
at use, so it never receives gradients (its variables are `QuantizedArray`, not `Param`). NF4
follows the QLoRA paper (Dettmers et al., 2023): the 16 levels are the quantiles of a standard
normal rescaled to [-1, 1], each block of 64 weights is scaled by its absolute maximum, and two
4-bit codes are packed per byte. Double quantization of the block scales is not implemented:
the scales stay float32 (0.5 extra bits per weight instead of ~0.127).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array

from nonstop.models.validation import check, check_choice

QuantKind = Literal["nf4", "int8"]

NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)
NF4_BLOCK = 64


class QuantizedArray(nnx.Variable):
    """Quantized codes and their scales: frozen state, never a trainable parameter."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig:
    kind: QuantKind = "nf4"
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj")

    def __post_init__(self) -> None:
        check_choice("QuantConfig", "kind", self.kind, QuantKind)
        unknown = sorted(set(self.targets) - set(PROJECTIONS))
        check(not unknown, "QuantConfig", "targets", self.targets,
              f"projection names from {sorted(PROJECTIONS)} ({unknown} are not projections)")


# Projection name -> (owning submodule of a block, number of leading input axes).
PROJECTIONS: dict[str, tuple[str, int]] = {
    "q_proj": ("attn", 1), "k_proj": ("attn", 1), "v_proj": ("attn", 1), "o_proj": ("attn", 2),
    "gate_proj": ("mlp", 1), "up_proj": ("mlp", 1), "down_proj": ("mlp", 1),
}


class QuantizedWeight(nnx.Module):
    """A frozen weight stored as int8 or packed NF4 codes plus float32 scales."""

    def __init__(self, weight: Array, *, kind: QuantKind, n_in: int,
                 logical_axes: tuple[str | None, ...] | None = None):
        self.kind = kind
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self.logical_axes = logical_axes
        w = jnp.asarray(weight, jnp.float32)
        if kind == "int8":
            scale = jnp.max(jnp.abs(w), axis=tuple(range(n_in))) / 127.0
            scale = jnp.where(scale == 0, 1.0, scale)
            self.codes = QuantizedArray(jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8))
            self.scales = QuantizedArray(scale)
        else:
            flat = w.reshape(-1)
            pad = (-flat.size) % NF4_BLOCK
            blocks = jnp.pad(flat, (0, pad)).reshape(-1, NF4_BLOCK)
            absmax = jnp.max(jnp.abs(blocks), axis=1)
            absmax = jnp.where(absmax == 0, 1.0, absmax)
            normalized = blocks / absmax[:, None]
            levels = jnp.asarray(NF4_LEVELS)
            idx = jnp.argmin(jnp.abs(normalized[..., None] - levels), axis=-1).astype(jnp.uint8)
            self.codes = QuantizedArray((idx[:, 0::2] << 4) | idx[:, 1::2])
            self.scales = QuantizedArray(absmax)

    def dequantize(self, dtype: jnp.dtype) -> Array:
        codes, scales = self.codes[...], self.scales[...]
        if self.kind == "int8":
            return (codes.astype(jnp.float32) * scales).astype(dtype)
        hi, lo = codes >> 4, codes & 0x0F
        idx = jnp.stack([hi, lo], axis=-1).reshape(codes.shape[0], NF4_BLOCK)
        values = jnp.asarray(NF4_LEVELS)[idx] * scales[:, None]
        size = int(np.prod(self.shape))
        return values.reshape(-1)[:size].reshape(self.shape).astype(dtype)


def quantize_model(model: nnx.Module, cfg: QuantConfig = QuantConfig()) -> nnx.Module:
    """Replace the target projections of every block with quantized weights (in place)."""
    for block in model.layers:
        for name in cfg.targets:
            owner_name, n_in = PROJECTIONS[name]
            owner = getattr(block, owner_name)
            param = getattr(owner, name)
            if not isinstance(param, nnx.Param):
                raise TypeError(f"{owner_name}.{name} is already a {type(param).__name__}; "
                                "quantize before applying LoRA, and only once")
            setattr(owner, name, QuantizedWeight(param[...], kind=cfg.kind, n_in=n_in,
                                                 logical_axes=getattr(param, "logical_axes", None)))
    return model


def weight_value(weight: nnx.Param | QuantizedWeight, dtype: jnp.dtype) -> Array:
    """A projection's weight as an array in `dtype`, whatever holds it."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize(dtype)
    return weight[...].astype(dtype)


def quantization_error(weight: Array, kind: QuantKind, n_in: int = 1) -> float:
    """Relative Frobenius error of quantizing `weight` (for tests and reports)."""
    w = jnp.asarray(weight, jnp.float32)
    back = QuantizedWeight(w, kind=kind, n_in=n_in).dequantize(jnp.float32)
    return float(jnp.linalg.norm(back - w) / jnp.linalg.norm(w))


__all__ = ["NF4_LEVELS", "QuantConfig", "QuantizedArray", "QuantizedWeight", "quantize_model",
           "quantization_error", "weight_value"]
