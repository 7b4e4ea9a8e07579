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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from nonstop.models.safetensors_io import SafetensorsReader, aligned_buffer

_BLOCK_ROWS = 8  # rows per step of the blocked transpose; small blocks stay in L1


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


def transposed(stored: np.ndarray, perm: tuple[int, ...]) -> np.ndarray:
    """`stored.transpose(perm)` as a fresh C-contiguous, 64-byte-aligned array.

    Merging the axes that stay adjacent turns every layout of ours into a 2-D transpose
    (`[A..., B] -> [B, A...]`), done in blocks of rows so reads and writes both stay in cache.
    """
    out = aligned_buffer(stored.nbytes).view(stored.dtype).reshape(
        tuple(stored.shape[a] for a in perm))
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

    def blocks(start: int, stop: int) -> None:
        for i in range(start, stop, _BLOCK_ROWS):
            dst[:, i:i + _BLOCK_ROWS] = src[i:i + _BLOCK_ROWS, :].T

    # Row ranges on the cores (numpy copies release the GIL): the host transpose is the
    # loader's main cost beyond reading the bytes.
    step = max(_BLOCK_ROWS, -(-rows // _workers() // _BLOCK_ROWS) * _BLOCK_ROWS)
    if rows * cols < _PARALLEL_MIN_ELEMENTS or step >= rows:
        blocks(0, rows)
        return out
    futures = [_pool().submit(blocks, a, min(a + step, rows)) for a in range(0, rows, step)]
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


def host_layout(ours: np.ndarray, dtype: np.dtype, *, borrowed: bool) -> np.ndarray:
    """`ours` as a C-contiguous, 64-byte-aligned `dtype` array that a CPU device may adopt:
    `ours` itself when it already is one and not `borrowed`, else a fresh copy. Pure numpy (its
    copies run without the GIL), so several threads may prepare tensors at once."""
    dtype = np.dtype(dtype)
    stored, perm = as_stored(ours)
    if jax.dtypes.canonicalize_dtype(stored.dtype) != stored.dtype:  # float64 without x64
        stored = stored.astype(dtype)
    host = stored
    if perm != tuple(range(ours.ndim)) or (borrowed and stored.dtype == dtype):
        host = transposed(stored, perm)
    if host.dtype != dtype:
        cast = aligned_buffer(host.size * dtype.itemsize).view(dtype).reshape(host.shape)
        cast[...] = host
        host = cast
    return host


def place(ours: np.ndarray, dtype: np.dtype, sharding: Sharding, *, borrowed: bool,
          on_host: bool | None = None) -> jax.Array:
    """`ours` (a view of the bytes as read) as a `dtype` array on `sharding`.

    `borrowed`: the buffer `ours` views is reused once the result is ready, so the result must
    not adopt it. `on_host`: transpose on the host (default: when every device is a CPU).
    """
    dtype = np.dtype(dtype)
    stored, perm = as_stored(ours)
    identity = perm == tuple(range(ours.ndim))
    if jax.dtypes.canonicalize_dtype(stored.dtype) != stored.dtype:  # float64 without x64
        stored = stored.astype(dtype)
    if on_host is None:
        on_host = _all_cpu(sharding)
    if on_host or (identity and stored.dtype == dtype):
        host = host_layout(ours, dtype, borrowed=borrowed)
        return jax.make_array_from_callback(ours.shape, sharding, lambda idx: host[idx])
    src = sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ours.ndim - len(sharding.spec))
        inverse = np.argsort(perm)  # stored axis i is our axis inverse[i]
        src = NamedSharding(sharding.mesh, PartitionSpec(*(spec[a] for a in inverse)))
    raw = jax.make_array_from_callback(stored.shape, src, lambda idx: stored[idx])
    return _relayout(perm, dtype, sharding)(raw)


_IN_FLIGHT = 2  # tensors being read and transposed at once; each has its own staging buffer


def place_all(reader: SafetensorsReader,
              tensors: Sequence[tuple[str, Callable[[np.ndarray], np.ndarray], Sharding]],
              dtype: np.dtype) -> Iterator[jax.Array]:
    """`place` for each `(name, to_ours, sharding)` in turn, reading ahead.

    Worker threads read (and, for CPU devices, transpose and cast) the next tensors while the
    caller places this one; each reads into its own reused staging buffer, so at most
    `_IN_FLIGHT` tensors are on the host besides the results. A tensor already in our layout is
    read straight into the buffer its array then adopts on CPU: its bytes are written once.
    """
    dtype = np.dtype(dtype)
    if not tensors:
        return
    largest = max(reader.entries[name].end - reader.entries[name].start for name, *_ in tensors)
    staging = [aligned_buffer(largest) for _ in range(_IN_FLIGHT)]  # touched only as used

    def prepare(i: int) -> tuple[np.ndarray, bool]:
        """Tensor i in our layout: `(array, borrowed)`, ready to adopt when on CPU devices."""
        name, to_ours, sharding = tensors[i]
        entry = reader.entries[name]
        slot = staging[i % _IN_FLIGHT][:entry.end - entry.start]
        probe = to_ours(slot.view(entry.dtype).reshape(entry.shape))  # a view, nothing read
        in_place = probe.flags.c_contiguous and entry.dtype == dtype
        ours = to_ours(reader.read(name, into=None if in_place else slot))
        if _all_cpu(sharding):
            return host_layout(ours, dtype, borrowed=not in_place), False
        return ours, not in_place

    with ThreadPoolExecutor(_IN_FLIGHT, thread_name_prefix="checkpoint-read") as pool:
        pending = collections.deque(pool.submit(prepare, i)
                                    for i in range(min(_IN_FLIGHT, len(tensors))))
        for i, (_, _, sharding) in enumerate(tensors):
            ours, borrowed = pending.popleft().result()
            array = place(ours, dtype, sharding, borrowed=borrowed)
            if borrowed:
                array.block_until_ready()  # before task i + _IN_FLIGHT overwrites its buffer
            if i + _IN_FLIGHT < len(tensors):
                pending.append(pool.submit(prepare, i + _IN_FLIGHT))
            yield array
