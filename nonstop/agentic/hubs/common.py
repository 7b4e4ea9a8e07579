"""What the hub adapters share: import paths in `args`, and the held-out split of seeds.

The agentic recipe draws training tasks with `sample_task(seed)` for seeds from the run's seed on,
and held-out tasks for seeds from `HELD_OUT_SEED` on (its `EVAL_SEED_OFFSET`). An adapter that
reads a fixed list of tasks answers seed s with the training task s mod n, and seed
HELD_OUT_SEED + i with held-out task i mod m; without a split both come from the whole list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from nonstop.agentic.plugins import import_object

HELD_OUT_SEED = 1_000_000
T = TypeVar("T")


def import_if_path(obj: Any, field: str) -> Any:
    """`obj`, or the object it names when it is an import path 'module:attribute'."""
    if isinstance(obj, str):
        return import_object(obj, owner="args", field=field)
    return obj


def partition(items: Sequence[T], eval_fraction: float | None, *, key: Callable[[T], str]
              ) -> tuple[tuple[T, ...], tuple[T, ...]]:
    """(training, held-out): an item is held out when a stable hash of `key(item)` falls below
    `eval_fraction`; None: both are all items. A split leaving either side empty is refused."""
    if eval_fraction is None:
        return tuple(items), tuple(items)
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction!r} is invalid; expected a number in "
                         "(0, 1), or None for no split")

    def held(item: T) -> bool:
        digest = hashlib.blake2b(key(item).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < eval_fraction

    train = tuple(i for i in items if not held(i))
    held_out = tuple(i for i in items if held(i))
    if not train or not held_out:
        raise ValueError(f"eval_fraction={eval_fraction} leaves no "
                         f"{'training' if not train else 'held-out'} task among {len(items)}; "
                         "change it, or pass None to train and evaluate on all tasks")
    return train, held_out


def held_out_split(split: tuple[Sequence[T], Sequence[T]], seed: int) -> T:
    """The task for `seed` (see the module docstring)."""
    train, held_out = split
    if seed >= HELD_OUT_SEED:
        return held_out[(seed - HELD_OUT_SEED) % len(held_out)]
    return train[seed % len(train)]


__all__ = ["HELD_OUT_SEED", "held_out_split", "import_if_path", "partition"]
