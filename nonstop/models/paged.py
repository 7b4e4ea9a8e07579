"""Attention's reads and writes of a paged KV cache, in plain JAX, and the seam for kernels.

A paged layer cache is a pool of blocks [NB, K, bs, H] (blocks, kv heads, block size, head dim)
and, per batch row, a block table int32[B, MB]: row b's position p lives at offset p % bs of
block tables[b, p // bs]. A table entry of NB (or more) means "no block": writes there are
dropped, reads there return some block's contents, which attention masks out like any position
past the row's own.

`gather` copies a row's blocks into the dense [B, K, L, H] layout, so paged attention is the
dense computation over the same values (the masked positions contribute exact zeros): tokens
and logprobs equal the dense cache's. A platform kernel that reads blocks in place (JAX's Pallas
paged attention on TPU, say) plugs in through `register_kernel`; it is used only on its own
platform and must match this path (see `kernel_for`).
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


# A kernel: (q [B, N, H], keys pool, values pool, tables [B, MB], lengths int32[B], scale) ->
# [B, N, H], one query per row (decode) attending over its first `lengths` positions, scores
# scaled by `scale`.
PagedKernel = Callable[[Array, Array, Array, Array, Array, float], Array]
_KERNELS: dict[str, PagedKernel] = {}


def register_kernel(platform: str, kernel: PagedKernel) -> None:
    """Use `kernel` for decode attention over a paged cache on `platform` ("tpu", "gpu"),
    for layers without soft-capping or a window (the plain path serves the rest)."""
    _KERNELS[platform] = kernel


def kernel_for(platform: str | None = None) -> PagedKernel | None:
    """The kernel registered for `platform` (default: JAX's backend), or None."""
    return _KERNELS.get(platform or jax.default_backend())


__all__ = ["PagedKernel", "PagedLayer", "gather", "kernel_for", "register_kernel", "write"]
