"""Attention's reads and writes of a paged KV cache, in plain JAX, and the seam for kernels.

A paged layer cache is a pool of blocks [NB, K, bs, H] (blocks, kv heads, block size, head dim)
and, per batch row, a block table int32[B, MB]: row b's position p lives at offset p % bs of
block tables[b, p // bs]. A table entry of NB (or more) means "no block": writes there are
dropped, reads there return some block's contents, which attention masks out like any position
past the row's own.

`gather` copies a row's blocks into the dense [B, K, L, H] layout, so paged attention is the
dense computation over the same values (the masked positions contribute exact zeros): tokens
and logprobs equal the dense cache's. Prefill, sliding-window and soft-capped layers take that
path. Decode attention (one query a row) takes `attend_blocks` instead: it walks the tables a
few blocks at a time with an online softmax (flash-decoding), only as far as the longest live
row, so it never copies the rows' whole contexts out of the pool at once. On a 2-core CPU
(128 rows, 512 positions, the engine benchmark's layer) that is about 10x faster than the
gather, whose copy XLA runs element by element. A platform kernel that reads blocks in place
(JAX's Pallas paged attention on TPU, say) plugs in through `register_kernel`; it is used only
on its own platform and must match the plain paths (see `kernel_for`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array


class PagedLayer(NamedTuple):
    """One layer's pool of keys and of values [NB, K, bs, H], and the rows' block tables."""

    keys: Array
    values: Array
    tables: Array  # int32[B, MB]


def write(pool: Array, tables: Array, positions: Array, new: Array) -> Array:
    """`pool` with new [B, T, K, H] written at each row's `positions` int32[B, T]; positions
    past the table (or whose entry has no block) write nothing."""
    NB, _, bs, _ = pool.shape
    MB = tables.shape[1]
    index = positions // bs
    inside = (positions >= 0) & (index < MB)
    blocks = jnp.where(inside, jnp.take_along_axis(tables, jnp.clip(index, 0, MB - 1), axis=1),
                       NB)
    return pool.at[blocks, :, positions % bs, :].set(new.astype(pool.dtype), mode="drop")


def gather(pool: Array, tables: Array) -> Array:
    """The blocks of each row's table [B, n] as a dense cache [B, K, n * bs, H]."""
    B, n = tables.shape
    _, K, bs, H = pool.shape
    blocks = jnp.take(pool, tables, axis=0, mode="clip")  # [B, n, K, bs, H]
    return blocks.transpose(0, 2, 1, 3, 4).reshape(B, K, n * bs, H)


# Blocks `attend_blocks` reads per loop iteration: fewer iterations against a larger working
# set; 4 (64 positions at block size 16) was fastest of 1-32 on the 2-core CPU.
BLOCKS_PER_STEP = 4
_MASKED = -2.3819763e38  # as the dense path's mask: finite after a softmax shift


def attend_blocks(q: Array, k_pool: Array, v_pool: Array, tables: Array, lengths: Array,
                  scale: float) -> Array:
    """Decode attention over a paged cache: q [B, N, H], each row over its first `lengths`
    positions -> [B, N, H] (a `PagedKernel`, in plain JAX).

    The loop runs over groups of `BLOCKS_PER_STEP` table entries, as many as the longest row
    needs (rows with lengths past the table, parked ones, are not counted and get garbage);
    for a row the groups past its length add exact zeros and rescale by exactly one, so its
    result does not depend on the other rows (batch invariance). Scores are float32.
    """
    B, N, H = q.shape
    NB, K, bs, _ = k_pool.shape
    MB = tables.shape[1]
    per = min(BLOCKS_PER_STEP, MB)
    groups = -(-MB // per)
    span = per * bs
    if groups * per > MB:  # pad with "no block" entries (read clipped, masked)
        tables = jnp.pad(tables, ((0, 0), (0, groups * per - MB)), constant_values=NB)
    live = jnp.where(lengths <= MB * bs, lengths, 0)
    needed = jnp.minimum((jnp.max(live) + span - 1) // span, groups)
    qg = q.reshape(B, K, N // K, H)

    def read(pool: Array, ids: Array) -> Array:  # [B, per] -> [B, K, span, H]
        blocks = jnp.take(pool, ids, axis=0, mode="clip")  # [B, per, K, bs, H]
        return blocks.transpose(0, 2, 1, 3, 4).reshape(B, K, span, H).astype(q.dtype)

    def body(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        top, total, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(tables, i * per, per, axis=1)
        scores = jnp.einsum("bklh,bkgh->bkgl", read(k_pool, ids), qg).astype(jnp.float32)
        scores = scores * scale
        valid = (i * span + jnp.arange(span))[None, :] < lengths[:, None]  # [B, span]
        scores = jnp.where(valid[:, None, None, :], scores, _MASKED)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        shrink = jnp.exp(top - new_top)
        probs = jnp.exp(scores - new_top[..., None])
        total = total * shrink + probs.sum(axis=-1)
        acc = acc * shrink[..., None] + jnp.einsum("bklh,bkgl->bkgh", read(v_pool, ids),
                                                   probs.astype(q.dtype)).astype(jnp.float32)
        return new_top, total, acc

    G = N // K
    init = (jnp.full((B, K, G), -jnp.inf, jnp.float32), jnp.zeros((B, K, G), jnp.float32),
            jnp.zeros((B, K, G, H), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, needed, body, init)
    return (acc / total[..., None]).astype(q.dtype).reshape(B, N, H)


# A kernel: (q [B, N, H], keys pool, values pool, tables [B, MB], lengths int32[B], scale) ->
# [B, N, H], one query per row (decode) attending over its first `lengths` positions, scores
# scaled by `scale`.
PagedKernel = Callable[[Array, Array, Array, Array, Array, float], Array]
_KERNELS: dict[str, PagedKernel] = {}


def register_kernel(platform: str, kernel: PagedKernel) -> None:
    """Use `kernel` for decode attention over a paged cache on `platform` ("tpu", "gpu"),
    for layers without soft-capping or a window (the plain path serves the rest)."""
    _KERNELS[platform] = kernel


def kernel_for(platform: str | None = None) -> PagedKernel:
    """The kernel registered for `platform` (default: JAX's backend), else `attend_blocks`."""
    return _KERNELS.get(platform or jax.default_backend(), attend_blocks)


__all__ = ["BLOCKS_PER_STEP", "PagedKernel", "PagedLayer", "attend_blocks", "gather",
           "kernel_for", "register_kernel", "write"]
