"""Reference log-probabilities computed once per example, cached, and attached to training data.

Precomputed DPO runs the frozen reference over every example of the data once, before training:
the examples are encoded exactly as for training, padded one pair per row (so each row maps back
to its example), and the reference's per-token log-probs are stored per example origin
("file:line") in `RUN_DIR/reference_logprobs.npz` with a fingerprint of what produced them. A
resumed run, or a second run over the same data and model, loads the file instead of recomputing.
Under `jax.distributed` every process makes the same pass (each batch is a global array; the
log-probs come back whole to every host) and process 0 alone writes the file
(`nonstop.sft.trainer.reference_cache`).

`training_dataset` is `nonstop.sft.data.make_dataset` with one more step: after encoding, each
sequence gets its cached log-probs as `ref_logprobs`, so the packer lays them out next to the
tokens and the loss reads them from the batch. Arrays are stored at the example's full length (0
past any truncation), so the packer's `overlong="truncate"` cuts them exactly as it cuts tokens.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping

import grain
import jax
import numpy as np

from nonstop.models.tokenizer import Tokenizer
from nonstop.sft.data import DataConfig, ExampleEncoder, PackedBatchDataset
from nonstop.sft.datasets import open_source
from nonstop.train.batch import TrainBatch
from nonstop.train.packing import BatchPacker, PackUnit

CACHE_FILE = "reference_logprobs.npz"
ReferenceCache = Mapping[str, tuple[np.ndarray, ...]]  # origin -> per-sequence float32[L]
# host batch -> float32[B,T] reference log-probs of the whole batch (on every process)
LogprobFn = Callable[[TrainBatch], jax.Array | np.ndarray]


def _records(config: DataConfig) -> grain.MapDataset:
    sources = [grain.MapDataset.source(open_source(path)) for path in config.paths]
    return sources[0] if len(sources) == 1 else grain.MapDataset.concatenate(sources)


def compute_reference_logprobs(
    config: DataConfig, tokenizer: Tokenizer, logprob_fn: LogprobFn
) -> dict[str, tuple[np.ndarray, ...]]:
    """One pass over every example of `config` (no shuffle, one epoch) with `logprob_fn`.

    Every process that calls it encodes the same batches in the same order, so a collective
    `logprob_fn` (one that returns the whole batch to every process) is called equally often.
    """
    units = _records(config).map(ExampleEncoder(config, tokenizer))
    packing = dataclasses.replace(config.packing, mode="pad")
    cache: dict[str, tuple[np.ndarray, ...]] = {}
    pending: list[PackUnit] = []

    def run(batch_units: list[PackUnit], batch: TrainBatch) -> None:
        logprobs = np.asarray(jax.device_get(logprob_fn(batch)), np.float32)
        for row, unit in enumerate(batch_units):
            per_sequence = []
            for index, sequence in enumerate(unit):
                kept = np.flatnonzero(batch.segment_ids[row] == index + 1)  # after truncation
                values = np.zeros(len(sequence), np.float32)
                values[: len(kept)] = logprobs[row, kept]
                per_sequence.append(values)
            cache[unit[0].origin] = tuple(per_sequence)

    packer = BatchPacker(packing)
    for unit in units:
        packed = packer.add(unit)
        if packed is not None:  # `unit` opened the next batch; the finished one holds `pending`
            run(pending, packed.batch)
            pending = []
        pending.append(unit)
    last = packer.finish()
    if last is not None:
        run(pending, last.batch)
    return cache


def save_cache(path: str, cache: ReferenceCache, fingerprint: str) -> None:
    origins = sorted(cache)
    arrays = [array for origin in origins for array in cache[origin]]
    lengths = np.array([len(a) for a in arrays], np.int64)
    per_unit = np.array([len(cache[o]) for o in origins], np.int64)
    tmp = path + ".tmp.npz"
    np.savez(
        tmp,
        logprobs=np.concatenate(arrays) if arrays else np.zeros(0, np.float32),
        lengths=lengths,
        per_unit=per_unit,
        origins=np.array(origins),
        fingerprint=np.array(fingerprint),
    )
    os.replace(tmp, path)


def load_cache(path: str, fingerprint: str) -> dict[str, tuple[np.ndarray, ...]] | None:
    """The cache at `path`, or None if missing or made by something else."""
    if not os.path.exists(path):
        return None
    with np.load(path) as saved:
        if str(saved["fingerprint"]) != fingerprint:
            return None
        flat, lengths, per_unit = saved["logprobs"], saved["lengths"], saved["per_unit"]
        origins = [str(o) for o in saved["origins"]]
    arrays = np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []
    cache, index = {}, 0
    for origin, count in zip(origins, per_unit, strict=True):
        cache[origin] = tuple(arrays[index:index + count])
        index += count
    return cache


def fingerprint_of(**parts: object) -> str:
    """A stable text naming what produced a cache (data, model, tokenizer settings)."""
    return json.dumps(parts, sort_keys=True, default=repr)


class AttachReference(grain.transforms.Map):
    """Sets each sequence's `ref_logprobs` from the cache, by the example's origin."""

    def __init__(self, cache: ReferenceCache):
        self.cache = cache

    def map(self, unit: PackUnit) -> PackUnit:
        origin = unit[0].origin
        arrays = self.cache.get(origin)
        if arrays is None or len(arrays) != len(unit) or any(
            len(a) != len(s) for a, s in zip(arrays, unit, strict=True)
        ):
            raise ValueError(
                f"{origin}: no matching precomputed reference log-probs; the data changed since "
                f"they were computed — delete {CACHE_FILE} in the run directory to recompute"
            )
        return tuple(
            dataclasses.replace(s, ref_logprobs=a) for s, a in zip(unit, arrays, strict=True)
        )


def training_dataset(
    config: DataConfig, tokenizer: Tokenizer, cache: ReferenceCache | None = None
) -> grain.IterDataset:
    """`make_dataset`'s pipeline, with reference log-probs attached when `cache` is given."""
    records = _records(config)
    if config.shuffle:
        records = records.shuffle(seed=config.seed)
    units = records.repeat(config.num_epochs).map(ExampleEncoder(config, tokenizer))
    if cache is not None:
        units = units.map(AttachReference(cache))
    options = grain.ReadOptions(
        num_threads=config.read_threads, prefetch_buffer_size=4 * max(config.read_threads, 1)
    )
    return PackedBatchDataset(units.to_iter_dataset(options), config.packing)
