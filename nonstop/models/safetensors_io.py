"""Tensor-by-tensor reading of (possibly sharded) safetensors checkpoints through mmap.

The safetensors library copies whole tensors out of a mapping it keeps open for the file's
lifetime, so every page of a shard stays resident until the shard is closed. Loading large
checkpoints with a bounded footprint needs the opposite: view one tensor in the mapping,
convert it, hand it to the device, then tell the kernel its pages can go (MADV_DONTNEED). The
header format is the published safetensors one (8-byte little-endian length, JSON header).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


# Fault a tensor's pages in with one call instead of one page fault per 4 KiB (Linux >= 5.14's
# MADV_POPULATE_READ; plain read-ahead elsewhere).
_POPULATE = getattr(mmap, "MADV_POPULATE_READ", 22 if os.uname().sysname == "Linux" else None) \
    or getattr(mmap, "MADV_WILLNEED", None)


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
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{file}: not a safetensors file (shorter than its header)")
        (length,) = struct.unpack("<Q", raw)
        if length > os.path.getsize(file):
            raise CheckpointError(f"{file}: corrupt safetensors header length {length}")
        header = json.loads(f.read(length))
    base = 8 + length
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        entries[name] = TensorEntry(file=file, dtype=DTYPES[meta["dtype"]],
                                    shape=tuple(meta["shape"]), start=base + start, end=base + end)
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


class SafetensorsReader:
    """Random access to every tensor of a checkpoint, one tensor resident at a time."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.entries: dict[str, TensorEntry] = {}
        for file in checkpoint_files(self.directory):
            for name, entry in read_header(file).items():
                if name in self.entries:
                    raise CheckpointError(f"tensor {name!r} appears in both "
                                          f"{self.entries[name].file.name} and {file.name}")
                self.entries[name] = entry
        self._maps: dict[Path, mmap.mmap] = {}
        self._files: dict[Path, object] = {}

    def _map(self, file: Path) -> mmap.mmap:
        if file not in self._maps:
            f = open(file, "rb")  # noqa: SIM115 - closed in close()
            self._files[file] = f
            self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[file]

    def view(self, name: str) -> np.ndarray:
        """A read-only array viewing the mapped bytes (valid until `release`/`close`)."""
        e = self.entries[name]
        count = int(np.prod(e.shape)) if e.shape else 1
        self._advise(e, _POPULATE)
        arr = np.frombuffer(self._map(e.file), dtype=e.dtype, count=count, offset=e.start)
        return arr.reshape(e.shape)

    def release(self, name: str) -> None:
        """Let the kernel drop the tensor's pages (they are re-read from disk if touched again)."""
        self._advise(self.entries[name], getattr(mmap, "MADV_DONTNEED", None))

    def _advise(self, e: TensorEntry, advice: int | None) -> None:
        page = mmap.PAGESIZE
        start = (e.start // page) * page
        if advice is None or e.end <= start:
            return
        try:
            self._map(e.file).madvise(advice, start, e.end - start)
        except OSError:  # an older kernel without this advice: only slower, never wrong
            pass

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the mapping goes with it
                pass
        for f in self._files.values():
            f.close()  # type: ignore[attr-defined]
        self._maps.clear()
        self._files.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
