"""Tensor-by-tensor reading of (possibly sharded) safetensors checkpoints.

A tensor is either read with one `readinto` into its own 64-byte-aligned buffer (one copy out of
the page cache; on CPU JAX adopts such a buffer without copying) or viewed where it lies in the
file's pages (`mapped`: no copy at all, for a tensor that is copied anyway, as a transpose into
our layout does). Either way the host holds only the tensors in flight: a model placed from
mapped views would keep the file's pages and read the file after loading, and
`safetensors.numpy.load_file` returns a whole shard's tensors at once, so a shard is resident
before anything is placed.

The header format is the published safetensors one (8-byte little-endian length, JSON header);
every offset is checked against the file's size when the header is read, and again before a
tensor is read or mapped, so a truncated file is an error naming the file and the first tensor
it cuts off.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
import threading
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


_ALIGN = 64  # JAX's CPU client adopts host buffers aligned to this without a copy
_MAPPED_MIN = 1024**2  # buffers this large get a mapping of their own
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only


class CheckpointError(ValueError):
    """A checkpoint directory is missing files or tensors, or holds tensors we cannot use."""


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def read_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file holds, each checked to lie within the file."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{file}: not a safetensors file (shorter than its header)")
        (length,) = struct.unpack("<Q", raw)
        if 8 + length > size:
            raise CheckpointError(f"{file}: corrupt or truncated: header length {length} but the "
                                  f"file has {size} bytes")
        header = _parse_header(f.read(length), file)
    return _entries(header, 8 + length, size, file)


def load_blob(blob: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file held in memory (e.g. received over HTTP), copied out
    of `blob`; unlike `safetensors.numpy.load`, bfloat16 tensors load (as ml_dtypes')."""
    view = memoryview(blob).cast("B")
    where = "the blob"
    if len(view) < 8:
        raise CheckpointError(f"{where}: not a safetensors blob (shorter than its header)")
    (length,) = struct.unpack("<Q", view[:8])
    if 8 + length > len(view):
        raise CheckpointError(f"{where}: corrupt or truncated: header length {length} but the "
                              f"blob has {len(view)} bytes")
    header = _parse_header(bytes(view[8:8 + length]), where)
    return {name: np.frombuffer(view[e.start:e.end], dtype=e.dtype).reshape(e.shape).copy()
            for name, e in _entries(header, 8 + length, len(view), where).items()}


def _parse_header(raw: bytes, where: object) -> dict:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: not a safetensors file (header is not JSON: {e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: not a safetensors file (header is not a JSON object)")
    return header


def _entries(header: dict, base: int, size: int, where: object) -> dict[str, TensorEntry]:
    """The header's tensors with absolute offsets, each checked to lie within `size` bytes."""
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape = meta["dtype"], tuple(int(n) for n in meta["shape"])
            start, end = (int(n) for n in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: tensor {name!r} has a malformed header entry "
                                  f"{meta!r}") from e
        if dtype_name not in DTYPES:
            raise CheckpointError(f"{where}: tensor {name!r} has unsupported dtype {dtype_name}")
        dtype = DTYPES[dtype_name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - start != nbytes:
            raise CheckpointError(f"{where}: tensor {name!r} ({dtype_name} {list(shape)}) needs "
                                  f"{nbytes} bytes but its data_offsets span {end - start}")
        if start < 0 or base + end > size:
            raise CheckpointError(f"{where}: truncated: tensor {name!r} ends at byte {base + end} "
                                  f"but it has {size} bytes; re-download or re-save it")
        entries[name] = TensorEntry(file=Path(str(where)), dtype=dtype, shape=shape,
                                    start=base + start, end=base + end)
    return entries


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory, via its index when there is one."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = sorted({directory / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index} names {f.name}, which does not exist")
        return files
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{directory}: no model.safetensors, index or *.safetensors files")
    return found


def aligned_buffer(nbytes: int, *, populate: bool = True) -> np.ndarray:
    """An uninitialised uint8 buffer of `nbytes` starting on a 64-byte boundary.

    A large one is its own anonymous mapping, released when the last array viewing it is (JAX
    keeps an adopted one alive). With `populate`, the one `mmap` call faults all its pages in
    (`MAP_POPULATE`), faster than one thread faulting them one by one as it writes (a tensor
    read with one `read` call). A buffer that several threads fill at once is better not
    populated: each faults in the pages it writes, in parallel (the loader's transposes), and a
    reused buffer that may be only partly written is better not populated either
    (`docs/benchmarks.md`, `bench.load --phases`).
    """
    if nbytes >= _MAPPED_MIN:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (_POPULATE if populate else 0)
        mapping = mmap.mmap(-1, nbytes, flags=flags)
        return np.frombuffer(mapping, np.uint8)  # page-aligned
    buffer = np.empty(nbytes + _ALIGN, np.uint8)
    skip = -buffer.ctypes.data % _ALIGN
    return buffer[skip:skip + nbytes]


class SafetensorsReader:
    """Random access to every tensor of a checkpoint, each read with one copy from the file."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.entries: dict[str, TensorEntry] = {}
        for file in checkpoint_files(self.directory):
            for name, entry in read_header(file).items():
                if name in self.entries:
                    raise CheckpointError(f"tensor {name!r} appears in both "
                                          f"{self.entries[name].file.name} and {file.name}")
                self.entries[name] = entry
        self._files: dict[Path, int] = {}  # descriptors, read with pread: no shared offset
        self._open_lock = threading.Lock()

    def read(self, name: str, into: np.ndarray | None = None) -> np.ndarray:
        """Tensor `name` as a host array in `into` (an `aligned_buffer` of at least its size,
        reused across tensors) or, without one, in a fresh aligned buffer. Safe to call from
        several threads at once; the read itself runs without the GIL."""
        e = self.entries[name]
        nbytes = e.end - e.start
        if into is None:
            into = aligned_buffer(nbytes)
        elif into.nbytes < nbytes or into.ctypes.data % _ALIGN:
            raise ValueError(f"read({name!r}): buffer of {into.nbytes} bytes at alignment "
                             f"{into.ctypes.data % _ALIGN} cannot hold {nbytes} aligned bytes")
        data = into.reshape(-1).view(np.uint8)[:nbytes]
        fd = self._descriptor(e.file)
        view, done = memoryview(data), 0
        while done < nbytes:  # one read(2) returns at most ~2 GiB
            got = os.preadv(fd, [view[done:]], e.start + done)
            if not got:
                raise CheckpointError(f"{e.file}: truncated while reading tensor {name!r} "
                                      f"(got {done} of {nbytes} bytes; was the file rewritten "
                                      "during loading?)")
            done += got
        return data.view(e.dtype).reshape(e.shape)

    def mapped(self, name: str) -> np.ndarray:
        """Tensor `name` as a read-only view of the file's pages, mapped all at once: no copy
        out of the page cache. The pages stay resident while the view (or an array viewing it)
        lives, so keep it only while copying out of it; nothing here may adopt it."""
        e = self.entries[name]
        if e.end == e.start:
            return np.empty(e.shape, e.dtype)
        fd = self._descriptor(e.file)
        size = os.fstat(fd).st_size
        if size < e.end:  # a mapping past the end would fault when read
            raise CheckpointError(f"{e.file}: truncated since it was opened: tensor {name!r} "
                                  f"ends at byte {e.end} but the file has {size} bytes (was it "
                                  "rewritten during loading?)")
        base = e.start - e.start % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(fd, e.end - base, flags=mmap.MAP_SHARED | _POPULATE,
                            prot=mmap.PROT_READ, offset=base)
        data = np.frombuffer(mapping, np.uint8, e.end - e.start, e.start - base)
        return data.view(e.dtype).reshape(e.shape)

    def _descriptor(self, file: Path) -> int:
        with self._open_lock:
            if file not in self._files:
                self._files[file] = os.open(file, os.O_RDONLY)
            return self._files[file]

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
