"""LoRA adapters as wrappers around a block's projections (Hu et al., 2021).

`apply_lora(model, LoRAConfig(...))` replaces each target projection weight W with a
`LoRAWeight` holding W (frozen; a plain or quantized weight, so QLoRA is LoRA over
`quantize_model`) and two `nnx.LoRAParam`s A [*in, r] and B [r, *out], B zero-initialised so the
adapted model starts equal to the base. The forward is x·W + (alpha/r)·dropout(x)·A·B; only the
LoRAParams train (`TrainState.create(..., wrt=nnx.LoRAParam)`), `merge_lora` folds them
into plain weights for export and `strip_lora` drops them, leaving the base. Layers call
`project(x, weight, n_in)` and never know which kind of weight they hold.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from nonstop.models.quantize import PROJECTIONS, QuantizedWeight, weight_value
from nonstop.models.validation import check, check_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        check_int("LoRAConfig", "rank", self.rank)
        check(0.0 <= self.dropout < 1.0, "LoRAConfig", "dropout", self.dropout, "in [0, 1)")
        unknown = set(self.targets) - set(PROJECTIONS)
        check(bool(self.targets) and not unknown, "LoRAConfig", "targets", self.targets,
              f"a non-empty list of {sorted(PROJECTIONS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRAWeight(nnx.Module):
    """A frozen base weight plus a trainable low-rank update."""

    def __init__(self, base: nnx.Param | QuantizedWeight, *, n_in: int, cfg: LoRAConfig,
                 rngs: nnx.Rngs):
        shape = base.shape if isinstance(base, QuantizedWeight) else base[...].shape
        dtype = jnp.float32 if isinstance(base, QuantizedWeight) else base[...].dtype
        axes = getattr(base, "logical_axes", None) or (None,) * len(shape)
        in_shape, out_shape = shape[:n_in], shape[n_in:]
        fan_in = 1
        for d in in_shape:
            fan_in *= d
        bound = (1.0 / fan_in) ** 0.5  # kaiming-uniform(a=sqrt(5)) as in the reference code
        self.base = base
        self.n_in = n_in
        self.scale = cfg.scale
        self.lora_a = nnx.LoRAParam(
            jax.random.uniform(rngs.params(), (*in_shape, cfg.rank), dtype, -bound, bound),
            logical_axes=(*axes[:n_in], "lora_rank"))
        self.lora_b = nnx.LoRAParam(jnp.zeros((cfg.rank, *out_shape), dtype),
                                    logical_axes=("lora_rank", *axes[n_in:]))
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs) if cfg.dropout > 0 else None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape if isinstance(self.base, QuantizedWeight)
                     else self.base[...].shape)

    def delta(self, dtype: jnp.dtype) -> Array:
        a, b = self.lora_a[...].astype(dtype), self.lora_b[...].astype(dtype)
        return self.scale * jnp.tensordot(a, b, axes=1)

    def __call__(self, x: Array) -> Array:
        y = jnp.tensordot(x, weight_value(self.base, x.dtype), axes=self.n_in)
        h = self.dropout(x) if self.dropout is not None else x
        h = jnp.tensordot(h, self.lora_a[...].astype(x.dtype), axes=self.n_in)
        return y + self.scale * jnp.tensordot(h, self.lora_b[...].astype(x.dtype), axes=1)


def project(x: Array, weight: nnx.Param | QuantizedWeight | LoRAWeight, n_in: int) -> Array:
    """Contract the last `n_in` axes of x with the first `n_in` axes of the weight."""
    if isinstance(weight, LoRAWeight):
        return weight(x)
    return dense(x, weight_value(weight, x.dtype), n_in)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense(x: Array, w: Array, n_in: int) -> Array:
    """`tensordot(x, w, n_in)` with a weight gradient that transposes the smaller operand.

    Differentiated as is, JAX writes the weight gradient as `(dy^T x)^T`, and XLA's CPU backend
    then copies `dy` transposed for the product: for the gate and up projections that is the
    [tokens, mlp] activation gradient, twice the size of the [tokens, embed] input, and for the
    LM head the [tokens, vocab] logits gradient (`bench.rl_step --profile`, layout copies)."""
    return jnp.tensordot(x, w, axes=n_in)


def _dense_fwd(x: Array, w: Array, n_in: int) -> tuple[Array, tuple[Array, Array]]:
    return dense(x, w, n_in), (x, w)


def _dense_bwd(n_in: int, res: tuple[Array, Array], dy: Array) -> tuple[Array, Array]:
    x, w = res
    k = math.prod(w.shape[:n_in])
    n = math.prod(w.shape[n_in:])
    x2, dy2, w2 = x.reshape(-1, k), dy.reshape(-1, n), w.reshape(k, n)
    dx = jax.lax.dot_general(dy2, w2, (((1,), (1,)), ((), ())))
    tokens = (((0,), (0,)), ((), ()))
    if k <= n:
        dw = jax.lax.dot_general(x2, dy2, tokens)
    else:
        dw = jax.lax.dot_general(dy2, x2, tokens).T
    return dx.reshape(x.shape).astype(x.dtype), dw.reshape(w.shape).astype(w.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


def reseeded(model: nnx.Module, rng: Array) -> nnx.Module:
    """`model` with its dropout streams (LoRA dropout) reseeded from `rng`, for use inside a
    traced loss: a step merges the model inside its gradient trace from variables of the
    enclosing jit trace, which NNX refuses to mutate (TraceContextError). The copy is made at
    the gradient's level and holds the same arrays, so gradients still reach the original's."""
    graphdef, variables = nnx.split(model)
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x, variables))
    nnx.reseed(model, dropout=rng)
    return model


def _targets(model: nnx.Module, names: tuple[str, ...]):
    for block in model.layers:
        for name in names:
            owner_name, n_in = PROJECTIONS[name]
            yield getattr(block, owner_name), name, n_in


def apply_lora(model: nnx.Module, cfg: LoRAConfig, *, seed: int = 0) -> nnx.Module:
    """Wrap the target projections of every block with LoRA adapters (in place)."""
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    for owner, name, n_in in _targets(model, cfg.targets):
        base = getattr(owner, name)
        if isinstance(base, LoRAWeight):
            raise TypeError(f"{name} already has a LoRA adapter; merge_lora first")
        setattr(owner, name, LoRAWeight(base, n_in=n_in, cfg=cfg, rngs=rngs))
    return model


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Fold every adapter into a plain float weight W + (alpha/r)·A·B (in place).

    Quantized bases are dequantized to float32 first (and quantized projections without an
    adapter are dequantized as they are), so the merged model exports with `save_pretrained`.
    """
    for owner, name, _ in _targets(model, tuple(PROJECTIONS)):
        weight = getattr(owner, name)
        if isinstance(weight, QuantizedWeight):  # quantized but never adapted: dequantize too
            setattr(owner, name, nnx.Param(weight.dequantize(jnp.float32),
                                           logical_axes=weight.logical_axes))
            continue
        if not isinstance(weight, LoRAWeight):
            continue
        base = weight.base
        dtype = jnp.float32 if isinstance(base, QuantizedWeight) else base[...].dtype
        merged = weight_value(base, jnp.float32) + weight.delta(jnp.float32)
        axes = getattr(base, "logical_axes", None)
        setattr(owner, name, nnx.Param(merged.astype(dtype), logical_axes=axes))
    return model


def strip_lora(model: nnx.Module) -> nnx.Module:
    """Replace every adapter by the weight it wraps (in place): the model LoRA was applied to."""
    for owner, name, _ in _targets(model, tuple(PROJECTIONS)):
        weight = getattr(owner, name)
        if isinstance(weight, LoRAWeight):
            setattr(owner, name, weight.base)
    return model


def has_lora(model: nnx.Module) -> bool:
    return any(isinstance(getattr(o, n), LoRAWeight) for o, n, _ in _targets(model,
                                                                               tuple(PROJECTIONS)))
