"""Decoder building blocks: RMSNorm, grouped-query attention, gated MLP, and the block.

One implementation for every family; `ModelConfig` switches select Qwen2 biases, q/k norms,
Gemma's (1+w) norms, soft-capping, post-norms and sliding windows. Weights are stored in the
einsum-friendly layouts q [D, N, H], k/v [D, K, H], o [N, H, D], gate/up [D, F], down [F, D];
each parameter carries `logical_axes` metadata that `sharding.py` maps onto a mesh. A projection
may also be quantized or LoRA-wrapped (`quantize.py`, `lora.py`); `project` hides which.

Attention reads either the current segment-packed sequence (training, full forward) or a KV
cache laid out [S, K, L, H] (engine; or a paged pool of blocks with per-row block tables,
`paged.py`), in which case the new keys and values are written at
their positions first and queries attend to cache positions <= their own. `attend_len` (static)
reads only the cache's first positions: the engine's decode passes the smallest bucket that
holds every active row, so a step reads keys and values in proportion to the longest live
sequence, not the cache's size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from nonstop.models import paged
from nonstop.models.config import LayerType, ModelConfig
from nonstop.models.lora import project
from nonstop.models.rope import apply_rope

_MASKED = -2.3819763e38  # the most negative float32 that stays finite after a softmax shift


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...],
           dtype: jnp.dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    """x / rms(x) * w, or * (1 + w) for Gemma; statistics in float32."""

    def __init__(self, dim: int, *, eps: float, plus_one: bool, param_dtype: jnp.dtype):
        init = jnp.zeros if plus_one else jnp.ones
        self.scale = nnx.Param(init((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x: Array) -> Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = self.scale[...].astype(jnp.float32)
        if self.plus_one:
            return (xf * (1.0 + w)).astype(x.dtype)
        return w.astype(x.dtype) * xf.astype(x.dtype)


def softcap(x: Array, cap: float | None) -> Array:
    return x if cap is None else jnp.tanh(x / cap) * cap


class Attention(nnx.Module):
    """Grouped-query attention with optional biases, q/k norms, soft-capping and a window."""

    def __init__(self, cfg: ModelConfig, layer_type: LayerType, *, param_dtype: jnp.dtype,
                 rngs: nnx.Rngs):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.window = cfg.sliding_window if layer_type == "sliding" else None
        self.q_proj = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), param_dtype)
        self.k_proj = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.v_proj = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.o_proj = _param(rngs, (N, H, D), ("heads", "head_dim", "embed"), param_dtype)
        if cfg.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((N, H), param_dtype), logical_axes=("heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((K, H), param_dtype),
                                    logical_axes=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((K, H), param_dtype),
                                    logical_axes=("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H, eps=cfg.rms_norm_eps, plus_one=cfg.norm_plus_one,
                                  param_dtype=param_dtype)
            self.k_norm = RMSNorm(H, eps=cfg.rms_norm_eps, plus_one=cfg.norm_plus_one,
                                  param_dtype=param_dtype)

    def _project(self, x: Array, rope: tuple[Array, Array]) -> tuple[Array, Array, Array]:
        cfg, dt = self.cfg, x.dtype
        q = project(x, self.q_proj, 1)  # [B, T, N, H]
        k = project(x, self.k_proj, 1)  # [B, T, K, H]
        v = project(x, self.v_proj, 1)
        if cfg.attention_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attend(self, q: Array, k: Array, v: Array, allowed: Array) -> Array:
        """q [B,T,N,H], k/v [B,K,L,H], allowed [B,T,L] -> [B,T,N,H].

        The keys/values come first in both contractions: with a long cache and one query per row
        XLA's CPU dot is faster that way round.
        """
        B, T, N, H = q.shape
        K = k.shape[1]
        q = q.reshape(B, T, K, N // K, H)
        scores = jnp.moveaxis(jnp.einsum("bklh,btkgh->bkltg", k, q), 2, -1)  # [B,K,T,G,L]
        scores = softcap(scores.astype(jnp.float32) * self.cfg.attention_scale,
                         self.cfg.attn_softcap)
        scores = jnp.where(allowed[:, None, :, None, :], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bklh,bktgl->btkgh", v, probs)
        return out.reshape(B, T, N, H)

    def __call__(self, x: Array, rope: tuple[Array, Array], positions: Array,
                 segment_ids: Array, cache: tuple[Array, Array] | paged.PagedLayer | None,
                 slots: Array | None, lookahead: Array | None = None,
                 attend_len: int | None = None
                 ) -> tuple[Array, tuple[Array, Array] | paged.PagedLayer | None]:
        """`lookahead` int32[B, T] (default 0) lets a query also see that many following keys:
        Gemma 3's image tokens see their whole image (bidirectional within the image).
        `attend_len`: with a cache, attend over its first `attend_len` positions only; every
        row that matters must sit below it (rows parked at the cache's end see garbage)."""
        q, k, v = self._project(x, rope)
        B, T = positions.shape
        if cache is None:
            idx = jnp.arange(T)
            limit = idx[None, :] if lookahead is None else idx[None, :] + lookahead
            allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (
                limit[:, :, None] >= idx[None, None, :])
            if self.window is not None:
                allowed &= idx[None, :, None] - idx[None, None, :] < self.window
            out = self._attend(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), allowed)
            new_cache = None
        elif isinstance(cache, paged.PagedLayer):
            # Paged: the rows' block tables say where each position lives (`paged.py`).
            tables = cache.tables
            k_cache = paged.write(cache.keys, tables, positions, k)
            v_cache = paged.write(cache.values, tables, positions, v)
            new_cache = paged.PagedLayer(k_cache, v_cache, tables)
            kernel = paged.kernel_for()
            if (kernel is not None and T == 1 and lookahead is None and self.window is None
                    and self.cfg.attn_softcap is None):
                out = kernel(q[:, 0], k_cache, v_cache, tables, positions[:, 0] + 1,
                             self.cfg.attention_scale)[:, None]
                return project(out, self.o_proj, 2), new_cache
            bs = k_cache.shape[2]
            n = tables.shape[1] if attend_len is None else min(-(-attend_len // bs),
                                                               tables.shape[1])
            keys = paged.gather(k_cache, tables[:, :n])
            values = paged.gather(v_cache, tables[:, :n])
            out = self._attend_cache(q, keys, values, positions, lookahead)
        else:
            k_cache, v_cache = cache
            L = k_cache.shape[2]
            rows = jnp.arange(B) if slots is None else slots
            # Positions past the cache (idle slots are parked at L) are dropped, not wrapped.
            k_cache = k_cache.at[rows[:, None], :, positions, :].set(
                k.astype(k_cache.dtype), mode="drop")
            v_cache = v_cache.at[rows[:, None], :, positions, :].set(
                v.astype(v_cache.dtype), mode="drop")
            keys, values = (k_cache, v_cache) if slots is None else (k_cache[slots], v_cache[slots])
            if attend_len is not None and attend_len < L:
                keys, values = keys[:, :, :attend_len], values[:, :, :attend_len]
            out = self._attend_cache(q, keys, values, positions, lookahead)
            new_cache = (k_cache, v_cache)
        y = project(out, self.o_proj, 2)
        return y, new_cache

    def _attend_cache(self, q: Array, keys: Array, values: Array, positions: Array,
                      lookahead: Array | None) -> Array:
        """Queries at `positions` [B, T] over cached keys/values [B, K, L, H]: each sees the
        cache positions up to its own (plus `lookahead`), within its window."""
        cache_pos = jnp.arange(keys.shape[2])
        limit = positions if lookahead is None else positions + lookahead
        allowed = cache_pos[None, None, :] <= limit[:, :, None]
        if self.window is not None:
            allowed &= positions[:, :, None] - cache_pos[None, None, :] < self.window
        return self._attend(q, keys.astype(q.dtype), values.astype(q.dtype), allowed)


class MLP(nnx.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)); SwiGLU or GeGLU by config."""

    def __init__(self, cfg: ModelConfig, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.activation = cfg.activation
        self.gate_proj = _param(rngs, (D, F), ("embed", "mlp"), param_dtype)
        self.up_proj = _param(rngs, (D, F), ("embed", "mlp"), param_dtype)
        self.down_proj = _param(rngs, (F, D), ("mlp", "embed"), param_dtype)

    def __call__(self, x: Array) -> Array:
        gate = project(x, self.gate_proj, 1)
        if self.activation == "silu":
            gate = jax.nn.silu(gate)
        else:
            gate = jax.nn.gelu(gate, approximate=self.activation == "gelu_tanh")
        return project(gate * project(x, self.up_proj, 1), self.down_proj, 1)


class Block(nnx.Module):
    """Pre-norm residual block; Gemma 2/3 add norms on the attention and MLP outputs."""

    def __init__(self, cfg: ModelConfig, layer_type: LayerType, *, param_dtype: jnp.dtype,
                 rngs: nnx.Rngs):
        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, plus_one=cfg.norm_plus_one,
                           param_dtype=param_dtype)

        self.layer_type = layer_type
        self.post_norms = cfg.post_norms
        self.input_norm = norm()
        self.attn = Attention(cfg, layer_type, param_dtype=param_dtype, rngs=rngs)
        self.pre_mlp_norm = norm()
        self.mlp = MLP(cfg, param_dtype=param_dtype, rngs=rngs)
        if cfg.post_norms:
            self.post_attn_norm = norm()
            self.post_mlp_norm = norm()

    def __call__(self, x: Array, rope: tuple[Array, Array], positions: Array,
                 segment_ids: Array, cache: tuple[Array, Array] | paged.PagedLayer | None,
                 slots: Array | None, lookahead: Array | None = None,
                 attend_len: int | None = None
                 ) -> tuple[Array, tuple[Array, Array] | paged.PagedLayer | None]:
        h, cache = self.attn(self.input_norm(x), rope, positions, segment_ids, cache, slots,
                             lookahead, attend_len)
        if self.post_norms:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.pre_mlp_norm(x))
        if self.post_norms:
            h = self.post_mlp_norm(h)
        return x + h, cache
