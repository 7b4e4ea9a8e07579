"""Packing variable-length token sequences into fixed-shape `TrainBatch`es (host-side, NumPy).

Every batch has exactly `rows_per_batch` rows and a length `T` taken from a small tuple of
buckets, so a jitted step sees at most `len(buckets)` shapes. The unit of packing is a
`PackUnit`: a tuple of sequences that must share one row, side by side — one sequence for SFT
and RL, two (chosen, rejected) for preference pairs. All units of one stream have the same size
`k`, so within a row unit `j` occupies segments `k*j + 1 .. k*j + k`; for pairs that puts chosen
on odd and rejected on even segment ids, which is how the preference losses find them.

Two modes:
- `"pack"`: streaming first-fit. A unit goes into the first open row with room for it (in tokens
  and in segments); when no row has room and all rows are open, the batch is emitted and the unit
  starts the next one. Units are never split across rows or reordered across batches. `T` is the
  smallest bucket holding the fullest row.
- `"pad"`: one unit per row, `T` the smallest bucket holding the longest unit — the baseline a
  benchmark compares packing against.

A unit longer than the longest bucket is an error naming its origin, or, with
`overlong="truncate"`, is cut from the end (the longest sequences of a unit first, so a shared
prompt survives) and counted in `PackingStats`. The first token of every sequence is never a
loss target (see `nonstop.train.batch`), so the packer clears its `loss_mask`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Literal

import numpy as np

from nonstop.models.validation import check, check_choice, check_int
from nonstop.train.batch import TrainBatch

_FLOAT_FIELDS = ("advantages", "behavior_logprobs", "ref_logprobs", "old_logprobs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenSequence:
    """One tokenized sequence: int32[L] tokens, bool[L] loss mask, optional float32[L] arrays."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray | None = None
    behavior_logprobs: np.ndarray | None = None
    ref_logprobs: np.ndarray | None = None
    old_logprobs: np.ndarray | None = None
    origin: str = "<unknown>"  # where it came from, e.g. "train.jsonl:12", for error messages

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", np.asarray(self.tokens, dtype=np.int32))
        object.__setattr__(self, "loss_mask", np.asarray(self.loss_mask, dtype=bool))
        length = self.tokens.shape
        if self.tokens.ndim != 1 or len(self.tokens) == 0:
            raise ValueError(f"{self.origin}: tokens must be a non-empty 1-D array, got {length}")
        for name in ("loss_mask", *_FLOAT_FIELDS):
            value = getattr(self, name)
            if value is None:
                continue
            if name != "loss_mask":
                value = np.asarray(value, dtype=np.float32)
                object.__setattr__(self, name, value)
            if value.shape != length:
                raise ValueError(
                    f"{self.origin}: {name} has shape {value.shape}, tokens have {length}"
                )

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, length: int) -> TokenSequence:
        """The first `length` tokens of this sequence (and of every per-token array)."""
        changes = {
            name: getattr(self, name)[:length]
            for name in ("tokens", "loss_mask", *_FLOAT_FIELDS)
            if getattr(self, name) is not None
        }
        return dataclasses.replace(self, **changes)


PackUnit = tuple[TokenSequence, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackingConfig:
    """How sequences become fixed-shape batches."""

    buckets: tuple[int, ...] = (128, 256, 512, 1024)
    rows_per_batch: int = 8
    mode: Literal["pack", "pad"] = "pack"
    overlong: Literal["error", "truncate"] = "error"
    max_segments_per_row: int = 64  # static bound for per-sequence reductions ([B,M] arrays)

    def __post_init__(self) -> None:
        owner = "PackingConfig"
        buckets = tuple(self.buckets)
        check(bool(buckets) and all(isinstance(b, int) and not isinstance(b, bool) and b >= 2
                                    for b in buckets),
              owner, "buckets", self.buckets, "a non-empty list of ints >= 2")
        check(list(buckets) == sorted(set(buckets)), owner, "buckets", self.buckets,
              f"strictly increasing lengths, e.g. {sorted(set(buckets))}")
        object.__setattr__(self, "buckets", buckets)
        check_int(owner, "rows_per_batch", self.rows_per_batch)
        check_choice(owner, "mode", self.mode, ("pack", "pad"))
        check_choice(owner, "overlong", self.overlong, ("error", "truncate"))
        check_int(owner, "max_segments_per_row", self.max_segments_per_row)

    @property
    def max_length(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, length: int) -> int:
        """The smallest bucket holding `length` tokens."""
        for bucket in self.buckets:
            if length <= bucket:
                return bucket
        raise ValueError(f"length {length} exceeds the longest bucket {self.max_length}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackingStats:
    """What one batch (or, summed with `+`, several) cost in padding and truncation."""

    units: int = 0
    sequences: int = 0
    rows_used: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    truncated_units: int = 0
    truncated_tokens: int = 0

    @property
    def fill_ratio(self) -> float:
        total = self.real_tokens + self.padded_tokens
        return self.real_tokens / total if total else 0.0

    def __add__(self, other: PackingStats) -> PackingStats:
        return PackingStats(
            **{
                f.name: getattr(self, f.name) + getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one packed sequence landed: row, segment id (1-based), first column and length."""

    row: int
    segment: int
    start: int
    length: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedBatch:
    """A host-side `TrainBatch` of NumPy arrays, its packing stats, and where each sequence went.

    `placements` lists the batch's sequences in the order they were added to the packer, so the
    k-th sequence given is `placements[k]` (per-sequence values can be read back out of rows).
    """

    batch: TrainBatch
    stats: PackingStats
    placements: tuple[Placement, ...] = ()

    def gather(self, values: np.ndarray) -> list[np.ndarray]:
        """Per-sequence slices of a [B,T] array, in the order the sequences were added."""
        return [np.asarray(values[p.row, p.start:p.start + p.length]) for p in self.placements]


def _water_fill(lengths: list[int], budget: int) -> int:
    """The largest cap c with sum(min(l, c)) <= budget: cut the longest sequences first."""
    low, high = 0, max(lengths)
    while low < high:
        cap = (low + high + 1) // 2
        if sum(min(length, cap) for length in lengths) <= budget:
            low = cap
        else:
            high = cap - 1
    return low


class BatchPacker:
    """Streaming packer: `add` units one at a time, get each batch as soon as it is full."""

    def __init__(self, config: PackingConfig) -> None:
        self.config = config
        self._rows: list[list[PackUnit]] = []
        self._row_lengths: list[int] = []
        self._added: list[tuple[int, int]] = []  # (row, index in row) of each unit, in order
        self._unit_size: int | None = None
        self._truncated_units = 0
        self._truncated_tokens = 0

    @property
    def empty(self) -> bool:
        return not self._rows

    def add(self, unit: PackUnit) -> PackedBatch | None:
        """Adds `unit`; returns the finished batch when `unit` had to start a new one."""
        unit, truncated_tokens = self._checked(unit)
        length = sum(len(seq) for seq in unit)
        row = self._row_with_room(length, len(unit))
        finished = None
        if row is None and len(self._rows) == self.config.rows_per_batch:
            finished = self.finish()
        if row is None:
            self._rows.append([])
            self._row_lengths.append(0)
            row = len(self._rows) - 1
        self._added.append((row, len(self._rows[row])))
        self._rows[row].append(unit)
        self._row_lengths[row] += length
        # Counted after any `finish`, so a truncation belongs to the batch that holds the unit.
        self._truncated_units += int(truncated_tokens > 0)
        self._truncated_tokens += truncated_tokens
        return finished

    def finish(self) -> PackedBatch | None:
        """Emits the batch being filled (padded to `rows_per_batch` rows), or None if empty."""
        if not self._rows:
            return None
        packed = self._build()
        self._rows, self._row_lengths, self._added = [], [], []
        self._truncated_units = self._truncated_tokens = 0
        return packed

    def _checked(self, unit: PackUnit) -> tuple[PackUnit, int]:
        """The unit, validated and (by policy) truncated, and how many tokens were cut."""
        unit = tuple(unit)
        origin = unit[0].origin if unit else "<empty unit>"
        if not unit:
            raise ValueError("cannot pack an empty unit (a PackUnit needs at least one sequence)")
        if self._unit_size is None:
            self._unit_size = len(unit)
            if self.config.max_segments_per_row % len(unit):
                raise ValueError(
                    f"PackingConfig.max_segments_per_row={self.config.max_segments_per_row} "
                    f"must be a multiple of the unit size {len(unit)} (pairs need an even number)"
                )
        elif len(unit) != self._unit_size:
            raise ValueError(
                f"{origin}: unit of {len(unit)} sequences in a stream of {self._unit_size}-"
                "sequence units; one packer takes one kind of example"
            )
        lengths = [len(seq) for seq in unit]
        budget = self.config.max_length
        if sum(lengths) <= budget:
            return unit, 0
        if self.config.overlong == "error":
            raise ValueError(
                f"{origin}: example of {sum(lengths)} tokens (sequences {lengths}) exceeds the "
                f"longest bucket {budget} of PackingConfig.buckets={self.config.buckets}; add a "
                "longer bucket or set PackingConfig.overlong='truncate' to cut and count it"
            )
        if budget < len(unit):
            raise ValueError(
                f"{origin}: the longest bucket {budget} cannot hold {len(unit)} tokens"
            )
        cap = _water_fill(lengths, budget)
        cut = sum(lengths) - sum(min(length, cap) for length in lengths)
        return tuple(seq.truncated(cap) for seq in unit), cut

    def _row_with_room(self, length: int, segments: int) -> int | None:
        if self.config.mode == "pad":
            return None
        for index, (row, used) in enumerate(zip(self._rows, self._row_lengths, strict=True)):
            fits_tokens = used + length <= self.config.max_length
            fits_segments = len(row) * len(row[0]) + segments <= self.config.max_segments_per_row
            if fits_tokens and fits_segments:
                return index
        return None

    def _build(self) -> PackedBatch:
        rows_per_batch = self.config.rows_per_batch
        length = self.config.bucket_for(max(self._row_lengths))
        sequences = [seq for row in self._rows for unit in row for seq in unit]
        shape = (rows_per_batch, length)
        arrays = {
            "tokens": np.zeros(shape, np.int32),
            "positions": np.zeros(shape, np.int32),
            "segment_ids": np.zeros(shape, np.int32),
            "loss_mask": np.zeros(shape, bool),
        }
        for name in _FLOAT_FIELDS:
            present = [getattr(seq, name) is not None for seq in sequences]
            if all(present):
                arrays[name] = np.zeros(shape, np.float32)
            elif any(present):
                missing = sequences[present.index(False)].origin
                raise ValueError(
                    f"{missing}: has no {name} while other sequences in its batch do; "
                    "every sequence of a stream must carry the same per-token arrays"
                )
        where: dict[tuple[int, int], list[Placement]] = {}
        for row_index, row in enumerate(self._rows):
            start, segment = 0, 0
            for unit_index, unit in enumerate(row):
                where[row_index, unit_index] = [
                    Placement(row=row_index, segment=segment + k + 1,
                              start=start + sum(len(s) for s in unit[:k]), length=len(seq))
                    for k, seq in enumerate(unit)
                ]
                start += sum(len(seq) for seq in unit)
                segment += len(unit)
        for row_index, row in enumerate(self._rows):
            start, segment = 0, 0
            for seq in (seq for unit in row for seq in unit):
                segment += 1
                span = slice(start, start + len(seq))
                arrays["tokens"][row_index, span] = seq.tokens
                arrays["positions"][row_index, span] = np.arange(len(seq))
                arrays["segment_ids"][row_index, span] = segment
                arrays["loss_mask"][row_index, span] = seq.loss_mask
                arrays["loss_mask"][row_index, start] = False  # nothing predicts a first token
                for name in _FLOAT_FIELDS:
                    if name in arrays:
                        arrays[name][row_index, span] = getattr(seq, name)
                start += len(seq)
        real_tokens = sum(self._row_lengths)
        stats = PackingStats(
            units=sum(len(row) for row in self._rows),
            sequences=len(sequences),
            rows_used=len(self._rows),
            real_tokens=real_tokens,
            padded_tokens=rows_per_batch * length - real_tokens,
            truncated_units=self._truncated_units,
            truncated_tokens=self._truncated_tokens,
        )
        placements = tuple(p for key in self._added for p in where[key])
        return PackedBatch(batch=TrainBatch(**arrays), stats=stats, placements=placements)


def pack_least_padding(units: Iterable[PackUnit], config: PackingConfig) -> list[PackedBatch]:
    """A finite set of units (an RL step's episodes) in as many batches as streaming first-fit
    makes (one optimizer step each, so the training is the same), with the least padding: rows
    as long as each bucket in turn are tried (buckets shorter than a unit are skipped), and the
    layout with that many batches and the fewest rows x length slots wins (ties: the shorter
    bucket). First-fit alone fills rows up to the longest bucket, which leaves most rows of a
    batch empty when a step holds fewer tokens than a batch of that bucket."""
    units = [tuple(u) for u in units]
    best = list(pack_units(units, config))
    if config.mode == "pad" or len(config.buckets) == 1 or not best:
        return best
    longest = max(sum(len(seq) for seq in u) for u in units)
    slots = sum(p.batch.tokens.size for p in best)
    for bucket in config.buckets[:-1]:
        if longest > bucket:
            continue
        capped = dataclasses.replace(config, buckets=tuple(b for b in config.buckets
                                                           if b <= bucket))
        batches = list(pack_units(units, capped))
        size = sum(p.batch.tokens.size for p in batches)
        if len(batches) == len(best) and size < slots:
            best, slots = batches, size
    return best


def pack_units(units: Iterable[PackUnit], config: PackingConfig) -> Iterator[PackedBatch]:
    """Packs a finite or endless stream of units into batches, the last one partly filled."""
    packer = BatchPacker(config)
    for unit in units:
        packed = packer.add(unit)
        if packed is not None:
            yield packed
    last = packer.finish()
    if last is not None:
        yield last
