"""Placing a checkpoint tensor, read in the file's layout, onto its devices in ours.

Our layouts are reshapes and transposes of Hugging Face's, so a tensor in our layout is a strided
view of the bytes as read. Where that transpose runs depends on the devices:
  - CPU devices: on the host, as one blocked copy into a fresh 64-byte-aligned buffer, which
    JAX's CPU client then adopts without copying again. XLA would transpose no faster here, and
    compiling one program per weight shape costs more than the transposes themselves.
  - accelerators: on the devices. The stored bytes cross as they are, split along the same mesh
    axes as the result, so each device transposes and casts only its own shard, with no
    communication; the host does no strided copy at all.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from nonstop.models.safetensors_io import SafetensorsReader, aligned_buffer

_BLOCK_ROWS = 8  # rows per step of the first pass; a block stays in L1
_CHUNK_ROWS = 128  # rows per pass pair; the staging chunk stays in L2
_WORD = np.dtype(np.uint64)


def as_stored(ours: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """`(stored, perm)`: a C-contiguous array with `ours == stored.transpose(perm)`.

    Ordering the axes of `ours` by stride gives back the buffer it views, without a copy; a view
    that is not a permutation of one buffer is copied.
    """
    identity = tuple(range(ours.ndim))
    if ours.flags.c_contiguous:
        return ours, identity
    order = sorted(identity, key=lambda axis: -ours.strides[axis])
    stored = ours.transpose(order)
    if not stored.flags.c_contiguous:
        return np.ascontiguousarray(ours), identity
    return stored, tuple(int(axis) for axis in np.argsort(order))


def _as_bits(a: np.ndarray) -> np.ndarray:
    """The same bytes as unsigned integers: numpy's native copy loops, not ml_dtypes' per-element
    ones (an order of magnitude faster for strided bfloat16 copies)."""
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.itemsize in (1, 2, 4, 8) else a


_scratch = threading.local()


def _scratch_words(count: int) -> np.ndarray:
    """This thread's reused staging buffer of at least `count` 8-byte words."""
    buffer = getattr(_scratch, "words", None)
    if buffer is None or buffer.size < count:
        buffer = _scratch.words = np.empty(count, _WORD)
    return buffer[:count]


def _transpose_rows(src: np.ndarray, dst: np.ndarray, start: int, stop: int) -> None:
    """`dst[:, start:stop] = src[start:stop].T` for a 2-D `src` (`_as_bits` of a tensor).

    numpy's strided copy pays per inner loop, and a plain transpose's inner loops are a few
    elements long. So when whole 8-byte words fit in a row, two passes per chunk of rows: the
    words (`lanes` elements of one row each) are transposed into a small scratch buffer, eight
    times fewer steps for 2-byte elements, then each word's lanes are scattered to their rows
    with inner loops as long as the chunk (`docs/benchmarks.md`, `bench.load --phases`).
    """
    rows, cols = src.shape
    lanes = _WORD.itemsize // src.dtype.itemsize
    if lanes <= 1 or cols % lanes:
        for i in range(start, stop, _BLOCK_ROWS):
            end = min(i + _BLOCK_ROWS, stop)
            dst[:, i:end] = src[i:end, :].T
        return
    words = src.view(_WORD)  # [rows, cols / lanes]
    lanes_of = dst.reshape(cols // lanes, lanes, rows)
    for chunk in range(start, stop, _CHUNK_ROWS):
        n = min(_CHUNK_ROWS, stop - chunk)
        scratch = _scratch_words(words.shape[1] * n).reshape(words.shape[1], n)
        for i in range(0, n, _BLOCK_ROWS):
            scratch[:, i:i + _BLOCK_ROWS] = words[chunk + i:chunk + min(i + _BLOCK_ROWS, n), :].T
        lanes_of[:, :, chunk:chunk + n] = (
            scratch.view(src.dtype).reshape(words.shape[1], n, lanes).transpose(0, 2, 1))


def transposed(stored: np.ndarray, perm: tuple[int, ...],
               out: np.ndarray | None = None) -> np.ndarray:
    """`stored.transpose(perm)` as a C-contiguous, 64-byte-aligned array: written into `out` (an
    `aligned_buffer` of `stored.nbytes`) or into a fresh buffer.

    Merging the axes that stay adjacent turns every layout of ours into a 2-D transpose
    (`[A..., B] -> [B, A...]`), done by ranges of the result's rows on the process's cores.
    """
    if out is None:
        out = aligned_buffer(stored.nbytes, populate=False)
    out = out.view(stored.dtype).reshape(tuple(stored.shape[a] for a in perm))
    groups: list[list[int]] = []
    for axis in perm:
        if groups and axis == groups[-1][-1] + 1:
            groups[-1].append(axis)
        else:
            groups.append([axis])
    if len(groups) != 2 or stored.size == 0:
        _as_bits(out)[...] = _as_bits(stored).transpose(perm)
        return out
    cols = int(np.prod([stored.shape[a] for a in groups[0]]))
    rows = stored.size // cols
    src = _as_bits(stored).reshape(rows, cols)
    dst = _as_bits(out).reshape(cols, rows)
    # The result's rows (the source's columns) in ranges, one per core (numpy copies release
    # the GIL): each core writes pages of its own, so where `out` is fresh its pages are faulted
    # in on every core at once, as they are written, instead of on one beforehand.
    lanes = max(1, _WORD.itemsize // src.dtype.itemsize)
    step = -(-cols // _workers() // lanes) * lanes
    if rows * cols < _PARALLEL_MIN_ELEMENTS or step >= cols:
        _transpose_rows(src, dst, 0, rows)
        return out
    futures = [_pool().submit(_transpose_rows, src[:, a:a + step], dst[a:a + step], 0, rows)
               for a in range(0, cols, step)]
    for future in futures:
        future.result()
    return out


_PARALLEL_MIN_ELEMENTS = 1 << 16  # smaller transposes are not worth a hand-off


def _workers() -> int:
    """The cores this process may run on (its affinity mask), at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, cores or 1))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_workers(), thread_name_prefix="checkpoint-transpose")


@functools.lru_cache(maxsize=64)
def _relayout(perm: tuple[int, ...], dtype: np.dtype, sharding: Sharding):
    return jax.jit(lambda x: jnp.transpose(x, perm).astype(dtype), out_shardings=sharding)


def _all_cpu(sharding: Sharding) -> bool:
    return all(d.platform == "cpu" for d in sharding.device_set)


def host_layout(ours: np.ndarray, dtype: np.dtype, *, borrowed: bool,
                out: np.ndarray | None = None) -> np.ndarray:
    """`ours` as a C-contiguous, 64-byte-aligned `dtype` array that a CPU device may adopt:
    `ours` itself when it already is one and not `borrowed`, else a copy, written into `out`
    (an `aligned_buffer` of the result's size) when given. Pure numpy (its copies run without
    the GIL), so several threads may prepare tensors at once."""
    dtype = np.dtype(dtype)
    stored, perm = as_stored(ours)
    if jax.dtypes.canonicalize_dtype(stored.dtype) != stored.dtype:  # float64 without x64
        stored = stored.astype(dtype)
    host = stored
    if perm != tuple(range(ours.ndim)) or (borrowed and stored.dtype == dtype):
        host = transposed(stored, perm, out if stored.dtype == dtype else None)
    if host.dtype != dtype:
        cast = out if out is not None else aligned_buffer(host.size * dtype.itemsize)
        cast = cast.view(dtype).reshape(host.shape)
        cast[...] = host
        host = cast
    return host


def place(ours: np.ndarray, dtype: np.dtype, sharding: Sharding, *, borrowed: bool,
          on_host: bool | None = None, out: np.ndarray | None = None) -> jax.Array:
    """`ours` (a view of the bytes as read) as a `dtype` array on `sharding`.

    `borrowed`: the buffer `ours` views is reused once the result is ready, so the result must
    not adopt it. `on_host`: transpose on the host (default: when every device is a CPU), into
    `out` when given (see `host_layout`).
    """
    dtype = np.dtype(dtype)
    stored, perm = as_stored(ours)
    identity = perm == tuple(range(ours.ndim))
    if jax.dtypes.canonicalize_dtype(stored.dtype) != stored.dtype:  # float64 without x64
        stored = stored.astype(dtype)
    if on_host is None:
        on_host = _all_cpu(sharding)
    if on_host or (identity and stored.dtype == dtype):
        host = host_layout(ours, dtype, borrowed=borrowed, out=out)
        return jax.make_array_from_callback(ours.shape, sharding, lambda idx: host[idx])
    src = sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ours.ndim - len(sharding.spec))
        inverse = np.argsort(perm)  # stored axis i is our axis inverse[i]
        src = NamedSharding(sharding.mesh, PartitionSpec(*(spec[a] for a in inverse)))
    raw = jax.make_array_from_callback(stored.shape, src, lambda idx: stored[idx])
    return _relayout(perm, dtype, sharding)(raw)


_READ_AHEAD = 1  # tensors being read while one is placed


def place_all(reader: SafetensorsReader,
              tensors: Sequence[tuple[str, Callable[[np.ndarray], np.ndarray]]],
              shardings: Iterable[Sharding], dtype: np.dtype, *, on_cpu: bool
              ) -> Iterator[jax.Array]:
    """`place` for each `(name, to_ours)` in turn on the next of `shardings`, reading ahead.

    One thread gets the next tensor while the caller transposes and places this one on the
    process's cores. A tensor already in our layout is read straight into the buffer its
    array then adopts on CPU: its bytes are written once. Any other is a view of the file's
    pages (`SafetensorsReader.mapped`: no copy out of the page cache), transposed into a fresh
    buffer that the reading thread maps and the cores writing it fault in (`on_cpu`: every
    device is a CPU) or, for accelerators,
    sent as stored. So the host holds at most two tensors besides the results. `shardings` is
    consumed one at a time as each tensor is placed, the first once the first read has begun:
    a generator may build what the shardings come from meanwhile. More reading threads only
    contend for the cores the transposes use.
    """
    dtype = np.dtype(dtype)

    def fetch(i: int) -> tuple[np.ndarray, bool, np.ndarray | None]:
        """Tensor i viewed in our layout: `(ours, borrowed, out)`, with `out` the fresh buffer
        for its host layout when it is borrowed from the file and bound for CPU devices."""
        name, to_ours = tensors[i]
        entry = reader.entries[name]
        # Whether our layout is the stored one: asked of an array whose pages are never touched.
        in_place = to_ours(np.empty(entry.shape, entry.dtype)).flags.c_contiguous
        if in_place and entry.dtype == dtype:
            return to_ours(reader.read(name)), False, None
        ours = to_ours(reader.mapped(name))
        out = aligned_buffer(ours.size * dtype.itemsize, populate=False) if on_cpu else None
        return ours, True, out

    shardings = iter(shardings)
    with ThreadPoolExecutor(_READ_AHEAD, thread_name_prefix="checkpoint-read") as pool:
        pending = collections.deque(pool.submit(fetch, i)
                                    for i in range(min(_READ_AHEAD, len(tensors))))
        for i in range(len(tensors)):
            sharding = next(shardings)
            ours, borrowed, out = pending.popleft().result()
            if i + _READ_AHEAD < len(tensors):
                pending.append(pool.submit(fetch, i + _READ_AHEAD))
            array = place(ours, dtype, sharding, borrowed=borrowed, out=out)
            if borrowed:
                array.block_until_ready()  # before the file's pages are unmapped
            del ours
            yield array
