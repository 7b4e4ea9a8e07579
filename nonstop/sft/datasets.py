"""Local JSONL and Parquet files as Grain random-access data sources of records.

Each source is a sequence of `SourceRecord`s — a dict of fields and its origin ("file:line" for
JSONL, "file:row N" for Parquet) — so every later error about a record can say where it came from.
`JsonlSource` indexes the byte offset of each non-blank line once and parses a line only when it
is read, so a large file costs one pass of I/O and little memory; a malformed line is an error
naming the file and its line number. `ParquetSource` needs pyarrow (an optional dependency): without
it, opening a Parquet file is an error that says how to install it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SUFFIXES = (".jsonl", ".parquet")


@dataclasses.dataclass(frozen=True)
class SourceRecord:
    """One example as read from disk: its fields and where it came from."""

    fields: Mapping[str, Any]
    origin: str


class JsonlSource(Sequence[SourceRecord]):
    """A JSONL file (one JSON object per line; blank lines skipped) with random access."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"JSONL file {self.path} does not exist")
        offsets: list[int] = []
        line_numbers: list[int] = []
        position = 0
        with open(self.path, "rb") as handle:
            for line_number, line in enumerate(handle, start=1):
                if line.strip():
                    offsets.append(position)
                    line_numbers.append(line_number)
                position += len(line)
        if not offsets:
            raise ValueError(f"{self.path}: no records (the file is empty)")
        self._offsets = offsets
        self._line_numbers = line_numbers

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index: int) -> SourceRecord:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(f"{self.path}: record {index} out of range [0, {len(self)})")
        origin = f"{self.path}:{self._line_numbers[index]}"
        # One open per read keeps the source picklable and safe under Grain's reader threads.
        with open(self.path, "rb") as handle:
            handle.seek(self._offsets[index])
            line = handle.readline()
        try:
            value = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{origin}: malformed JSON line ({error})") from None
        if not isinstance(value, dict):
            raise ValueError(
                f"{origin}: each line must be a JSON object, got {type(value).__name__}"
            )
        return SourceRecord(fields=value, origin=origin)

    def __repr__(self) -> str:
        return f"JsonlSource({str(self.path)!r}, records={len(self)})"


def _import_pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as parquet  # optional dependency
    except ImportError:
        raise ImportError(
            "reading Parquet files needs pyarrow, which is not installed; install it with "
            "`pip install 'nonstop[parquet]'` (or convert the data to JSONL)"
        ) from None
    return parquet


class ParquetSource(Sequence[SourceRecord]):
    """A Parquet file with random access to its rows (needs pyarrow)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"Parquet file {self.path} does not exist")
        parquet = _import_pyarrow_parquet()
        try:
            self._table = parquet.read_table(self.path)
        except Exception as error:  # pyarrow raises its own ArrowInvalid family
            raise ValueError(f"{self.path}: not a readable Parquet file ({error})") from None
        if self._table.num_rows == 0:
            raise ValueError(f"{self.path}: no records (the table has no rows)")

    def __len__(self) -> int:
        return self._table.num_rows

    def __getitem__(self, index: int) -> SourceRecord:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(f"{self.path}: row {index} out of range [0, {len(self)})")
        index %= len(self)
        fields = self._table.slice(index, 1).to_pylist()[0]
        return SourceRecord(fields=fields, origin=f"{self.path}:row {index}")

    def __repr__(self) -> str:
        return f"ParquetSource({str(self.path)!r}, records={len(self)})"


def open_source(path: str | os.PathLike) -> JsonlSource | ParquetSource:
    """The source for one file, chosen by its suffix."""
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        return JsonlSource(path)
    if suffix == ".parquet":
        return ParquetSource(path)
    raise ValueError(f"{path}: unsupported data file suffix {suffix!r}; valid: {SUFFIXES}")
