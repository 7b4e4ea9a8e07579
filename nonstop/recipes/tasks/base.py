"""The `Task` protocol every built-in task follows, and the split rule for tasks that generate data.

A task names itself, hands out `Example`s (prompt, reference answer, metadata) for training and for
held-out evaluation, scores completions with its `reward`, and writes a correct completion for any
example (`demonstration`) so a model can be warmed up with SFT before RL.

Generated tasks split their problem space, not their sample streams: a problem belongs to the eval
split when a stable hash of its prompt falls below `eval_fraction` (`split_of`, the same rule
the built-in agentic environments use). Training and evaluation therefore never share a problem,
whatever seeds or sizes are asked for.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import random
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from nonstop.agentic.environment import Split, split_of
from nonstop.models.validation import check
from nonstop.rl.rewards import Example, Reward


class TaskError(ValueError):
    """A task cannot produce what was asked: bad data in a file, or too few distinct problems."""


@runtime_checkable
class Task(Protocol):
    """What RL recipes need from a task."""

    @property
    def name(self) -> str: ...

    @property
    def reward(self) -> Reward: ...

    def sample(self, rng: random.Random) -> Example:
        """One training example drawn with `rng`."""
        ...

    def iter_examples(self, split: Split, seed: int) -> Iterator[Example]:
        """An endless, seeded stream of examples from `split`."""
        ...

    def train_examples(self, n: int, seed: int = 0) -> list[Example]:
        """`n` training examples, the same for the same seed."""
        ...

    def eval_examples(self, n: int, seed: int = 0) -> list[Example]:
        """`n` distinct held-out examples, never among the training examples."""
        ...

    def demonstration(self, example: Example) -> str:
        """A completion that scores 1.0 under `reward`, for SFT warm-up."""
        ...


def seeded_rng(task: str, split: Split, seed: int) -> random.Random:
    """The random stream for (`task`, `split`, `seed`); str seeds hash deterministically."""
    return random.Random(f"{task}/{split}/{seed}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GeneratedTask(abc.ABC):
    """A task that makes its own problems with `_generate(rng)`; subclasses add their settings."""

    eval_fraction: float = 0.1

    def __post_init__(self) -> None:
        check(0.0 < self.eval_fraction < 1.0, type(self).__name__, "eval_fraction",
              self.eval_fraction, "a number in (0, 1), exclusive")

    @property
    @abc.abstractmethod
    def name(self) -> str: ...

    @property
    @abc.abstractmethod
    def reward(self) -> Reward: ...

    @abc.abstractmethod
    def demonstration(self, example: Example) -> str: ...

    @abc.abstractmethod
    def _generate(self, rng: random.Random) -> Example:
        """One problem from the whole problem space, either split."""

    def _draw(self, rng: random.Random, split: Split) -> Example:
        for _ in range(10_000):
            example = self._generate(rng)
            if split_of(example.prompt, self.eval_fraction) == split:
                return example
        raise TaskError(f"{self.name}: no {split} problem in 10000 draws; check eval_fraction")

    def sample(self, rng: random.Random) -> Example:
        return self._draw(rng, "train")

    def iter_examples(self, split: Split, seed: int) -> Iterator[Example]:
        if split not in ("train", "eval"):
            raise ValueError(f"split = {split!r} is not valid; use 'train' or 'eval'")
        rng = seeded_rng(self.name, split, seed)
        for k in itertools.count():
            example = self._draw(rng, split)
            yield dataclasses.replace(example, id=f"{self.name}/{split}/{seed}/{k}")

    def train_examples(self, n: int, seed: int = 0) -> list[Example]:
        _check_count(n)
        return list(itertools.islice(self.iter_examples("train", seed), n))

    def eval_examples(self, n: int, seed: int = 0) -> list[Example]:
        _check_count(n)
        seen: dict[str, Example] = {}
        stream = self.iter_examples("eval", seed)
        for _ in range(100 * n + 1000):
            if len(seen) == n:
                break
            example = next(stream)
            seen.setdefault(example.prompt, example)
        if len(seen) < n:
            raise TaskError(
                f"{self.name}: found only {len(seen)} distinct eval problems of the {n} asked; "
                "ask for fewer, raise eval_fraction, or widen the task"
            )
        return list(seen.values())


def _check_count(n: int) -> None:
    if not (isinstance(n, int) and n >= 0):
        raise ValueError(f"n = {n!r} is not valid; it must be an int >= 0")
