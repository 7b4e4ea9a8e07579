"""Reward functions over completions, their weighted sums, and a failure-proof batch evaluator.

A reward is any callable `(prompt, completion, example) -> float`, or one returning an awaitable
(an `async def`), wrapped in a named `Reward`. Built-ins: `exact_match`, `numeric_match`,
`math_verify` (math-verify package, else SymPy), `format_reward`; `weighted` sums rewards and keeps
each term visible for logging.

`evaluate_rewards` scores a batch: every (episode, reward term) pair runs concurrently, sync rewards
in a thread executor so the event loop never blocks on them, async ones awaited. A term that
raises, times out, or returns NaN, inf or a non-number is a failure, counted per reward name and
reason, and handled by `on_error`: "skip" marks the episode invalid (its reward is 0.0 and it must
not be trained on), "zero" scores the term 0.0, "raise" raises `RewardError` naming the reward, the
episode, the example and the cause. No path yields a NaN reward.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import inspect
import math
import re
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Literal, Protocol, get_args

import numpy as np

from nonstop import perf
from nonstop.models.validation import check
from nonstop.rl.answers import (
    MathBackend,
    extract_answer,
    extract_boxed,
    math_equal,
    number_in,
    resolve_math_backend,
)

OnError = Literal["skip", "zero", "raise"]
FailureReason = Literal["exception", "timeout", "nan", "inf", "not_a_number"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Example:
    """One problem: the prompt text, the reference answer, and task-specific metadata (treat it
    as read-only). `id` names the example in error messages."""

    prompt: str
    answer: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    id: str = ""


class RewardFn(Protocol):
    """`(prompt, completion, example) -> float`, or an awaitable of one."""

    def __call__(
        self, prompt: str, completion: str, example: Example, /
    ) -> float | Awaitable[float]: ...


@dataclasses.dataclass(frozen=True)
class Reward:
    """A named reward function. `terms` is set by `weighted`: the (reward, weight) pairs whose sum
    `fn` computes, which `evaluate_rewards` scores (and reports) one by one."""

    name: str
    fn: RewardFn
    terms: tuple[tuple[Reward, float], ...] = ()

    def __post_init__(self) -> None:
        check(bool(self.name) and "/" not in self.name, "Reward", "name", self.name,
              "a non-empty name without '/'")
        check(callable(self.fn), "Reward", "fn", self.fn,
              f"a callable (prompt, completion, example) -> float for reward {self.name!r}")

    def __call__(self, prompt: str, completion: str, example: Example) -> float | Awaitable[float]:
        return self.fn(prompt, completion, example)

    @property
    def is_async(self) -> bool:
        """Whether calling this reward returns an awaitable (it is an `async def`)."""
        if self.terms:
            return any(r.is_async for r, _ in self.terms)
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            getattr(self.fn, "__call__", None)  # noqa: B004 — async callable objects
        )

    def leaves(self) -> tuple[tuple[Reward, float], ...]:
        """The plain (un-weighted) rewards inside this one, with their total weights."""
        if not self.terms:
            return ((self, 1.0),)
        return tuple((leaf, w * lw) for r, w in self.terms for leaf, lw in r.leaves())


def weighted(rewards: Sequence[tuple[Reward, float]], *, name: str = "weighted") -> Reward:
    """The reward `sum(weight * reward)`. Nested sums flatten; leaf names must be unique."""
    terms = tuple((r, float(w)) for r, w in rewards)
    if not terms:
        raise ValueError("weighted(rewards=[]) is not valid; give at least one (reward, weight)")
    for r, w in terms:
        if not isinstance(r, Reward):
            raise TypeError(f"weighted: {r!r} is not a Reward; wrap functions as Reward(name, fn)")
        if not math.isfinite(w):
            raise ValueError(f"weighted: weight of {r.name!r} is {w}; weights must be finite")
    names = [leaf.name for r, _ in terms for leaf, _ in r.leaves()]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"weighted: reward names {dupes} repeat; give each term a unique name")

    if any(r.is_async for r, _ in terms):

        async def total_async(prompt: str, completion: str, example: Example) -> float:
            values = [r(prompt, completion, example) for r, _ in terms]
            done = [await v if inspect.isawaitable(v) else v for v in values]
            return float(sum(w * v for (_, w), v in zip(terms, done, strict=True)))

        return Reward(name, total_async, terms)

    def total(prompt: str, completion: str, example: Example) -> float:
        return float(sum(w * r(prompt, completion, example) for r, w in terms))  # type: ignore[operator]

    return Reward(name, total, terms)


# -------------------------------------------------------------------------------- built-in rewards


def _normalize(text: str, case_sensitive: bool) -> str:
    text = " ".join(text.split())
    return text if case_sensitive else text.casefold()


def exact_match(*, name: str = "exact_match", case_sensitive: bool = True) -> Reward:
    """1.0 when the completion equals `example.answer` up to surrounding and repeated whitespace
    (and case, if not `case_sensitive`), else 0.0."""

    def score(prompt: str, completion: str, example: Example) -> float:
        same = _normalize(completion, case_sensitive) == _normalize(example.answer, case_sensitive)
        return float(same)

    return Reward(name, score)


def numeric_match(
    *,
    name: str = "numeric_match",
    marker: str | None = "####",
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
) -> Reward:
    """1.0 when the number the completion commits to (`\\boxed{}`, else after `marker`, else after
    "the answer is", else the last number) equals the reference within tolerance, else 0.0.
    A reference that is not a number raises: that is a data error, not a wrong answer."""
    if rel_tol < 0 or abs_tol < 0:
        raise ValueError(f"numeric_match: rel_tol={rel_tol}, abs_tol={abs_tol}; both must be >= 0")

    def score(prompt: str, completion: str, example: Example) -> float:
        gold = number_in(_reference_text(example.answer, marker))
        if gold is None:
            raise ValueError(f"reference answer {example.answer!r} is not a number")
        said = extract_answer(completion, marker=marker)
        pred = number_in(said) if said is not None else None
        return float(
            pred is not None and math.isclose(pred, gold, rel_tol=rel_tol, abs_tol=abs_tol)
        )

    return Reward(name, score)


def math_verify(
    *, name: str = "math_verify", backend: MathBackend = "auto", marker: str | None = "####"
) -> Reward:
    """1.0 when the completion's answer (as `numeric_match` finds it, or the whole completion if it
    names none) is mathematically equal to the reference ("0.5" vs "\\frac{1}{2}"), else 0.0.
    Uses the math-verify package if installed, else SymPy; raises ImportError if neither is."""
    resolve_math_backend(backend)  # fail at construction, not on the first episode

    def score(prompt: str, completion: str, example: Example) -> float:
        gold = _reference_text(example.answer, marker)
        said = extract_answer(completion, marker=marker)
        if said is not None and math_equal(gold, said, backend=backend):
            return 1.0
        return float(math_equal(gold, completion.strip(), backend=backend))

    return Reward(name, score)


def format_reward(
    pattern: str | re.Pattern[str] | None = None,
    *,
    tags: Sequence[str] = (),
    full_match: bool = False,
    name: str = "format",
) -> Reward:
    """1.0 when the completion matches `pattern` (searched, or matched whole if `full_match`; `.`
    spans newlines) and holds each `<tag>...</tag>` in `tags` exactly once, in the given order."""
    if pattern is None and not tags:
        raise ValueError("format_reward: give a pattern, tags, or both")
    regex = re.compile(pattern, re.DOTALL) if isinstance(pattern, str) else pattern
    for tag in tags:
        if not re.fullmatch(r"[\w-]+", tag):
            raise ValueError(
                f"format_reward: tag {tag!r} is not valid; use a bare name like 'answer'"
            )

    def score(prompt: str, completion: str, example: Example) -> float:
        if regex is not None:
            found = regex.fullmatch(completion) if full_match else regex.search(completion)
            if found is None:
                return 0.0
        at = 0
        for tag in tags:
            opens, closes = completion.count(f"<{tag}>"), completion.count(f"</{tag}>")
            start = completion.find(f"<{tag}>", at)
            end = completion.find(f"</{tag}>", start + 1) if start >= 0 else -1
            if opens != 1 or closes != 1 or start < 0 or end < 0:
                return 0.0
            at = end
        return 1.0

    return Reward(name, score)


def _reference_text(answer: str, marker: str | None) -> str:
    boxed = extract_boxed(answer)
    if boxed is not None:
        return boxed
    if marker and marker in answer:
        return answer.rsplit(marker, 1)[1].strip()
    return answer.strip()


# ------------------------------------------------------------------------------------- evaluation


class RewardError(RuntimeError):
    """A reward failed under `on_error="raise"`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardFailure:
    """One reward term that failed on one episode."""

    reward: str
    episode: int
    reason: FailureReason
    message: str
    exception: BaseException | None = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardResult:
    """Scores for a batch of B episodes.

    `rewards` is the weighted total, 0.0 where an episode is invalid, never NaN. `valid` is False
    only under on_error="skip" for episodes with a failed term. `components[name]` holds each
    leaf reward's raw value (0.0 where it failed), `component_ok[name]` where it succeeded.
    """

    rewards: np.ndarray  # float64[B]
    valid: np.ndarray  # bool[B]
    components: dict[str, np.ndarray]  # name -> float64[B]
    component_ok: dict[str, np.ndarray]  # name -> bool[B]
    failures: tuple[RewardFailure, ...]

    @property
    def failure_counts(self) -> dict[tuple[str, FailureReason], int]:
        """How many episodes each (reward name, reason) failed on."""
        return dict(collections.Counter((f.reward, f.reason) for f in self.failures))

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """Scalars for logging: mean total over valid episodes, mean of each term where it
        succeeded, the valid fraction, and failure counts by reward and reason."""
        out: dict[str, float] = {
            f"{prefix}/valid_fraction": float(self.valid.mean()) if self.valid.size else 0.0
        }
        if self.valid.any():
            out[f"{prefix}/mean"] = float(self.rewards[self.valid].mean())
        for key, values in self.components.items():
            ok = self.component_ok[key]
            if ok.any():
                out[f"{prefix}/{key}/mean"] = float(values[ok].mean())
        for (key, reason), n in self.failure_counts.items():
            out[f"{prefix}/failures/{key}/{reason}"] = float(n)
        return out


async def evaluate_rewards(
    reward: Reward,
    prompts: Sequence[str],
    completions: Sequence[str],
    examples: Sequence[Example],
    *,
    on_error: OnError = "skip",
    timeout_s: float | None = None,
    executor: concurrent.futures.Executor | None = None,
) -> RewardResult:
    """Score `completions[i]` (answering `prompts[i]` for `examples[i]`) under `reward`.

    Each leaf of `reward` is evaluated separately and concurrently; sync leaves run on `executor`
    (the loop's default thread pool if None). `timeout_s` bounds each call; a timed-out sync call
    keeps its thread until it returns, but the batch no longer waits for it.
    """
    if on_error not in get_args(OnError):
        raise ValueError(f"on_error = {on_error!r} is not valid; use one of {get_args(OnError)}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s = {timeout_s!r} is not valid; it must be > 0 or None")
    if not len(prompts) == len(completions) == len(examples):
        raise ValueError(
            f"evaluate_rewards: {len(prompts)} prompts, {len(completions)} completions and "
            f"{len(examples)} examples; the three must have the same length"
        )
    leaves = reward.leaves()
    batch = len(completions)
    with perf.span(perf.ROLLOUT_REWARD, episodes=batch):
        calls = [
            _score_one(leaf, i, prompts[i], completions[i], examples[i], timeout_s, executor)
            for i in range(batch)
            for leaf, _ in leaves
        ]
        outcomes = await asyncio.gather(*calls)

    failures = tuple(f for _, f in outcomes if f is not None)
    if failures and on_error == "raise":
        first = failures[0]
        ex = examples[first.episode]
        which = ex.id or repr(ex.prompt[:80])
        raise RewardError(
            f"reward {first.reward!r} failed on episode {first.episode} (example {which}): "
            f"{first.reason}: {first.message}"
        ) from first.exception

    values = np.zeros((batch, len(leaves)), np.float64)
    ok = np.ones((batch, len(leaves)), bool)
    for k, (value, failure) in enumerate(outcomes):
        i, j = divmod(k, len(leaves))
        if failure is None:
            values[i, j] = value
        else:
            ok[i, j] = False
    weights = np.array([w for _, w in leaves], np.float64)
    valid = ok.all(axis=1) if on_error == "skip" else np.ones(batch, bool)
    totals = np.where(valid, values @ weights, 0.0) if batch else np.zeros(0, np.float64)
    return RewardResult(
        rewards=totals,
        valid=valid,
        components={leaf.name: values[:, j] for j, (leaf, _) in enumerate(leaves)},
        component_ok={leaf.name: ok[:, j] for j, (leaf, _) in enumerate(leaves)},
        failures=failures,
    )


async def _score_one(
    leaf: Reward,
    episode: int,
    prompt: str,
    completion: str,
    example: Example,
    timeout_s: float | None,
    executor: concurrent.futures.Executor | None,
) -> tuple[float, RewardFailure | None]:
    def failed(reason: FailureReason, message: str, exc: BaseException | None = None) -> tuple:
        return 0.0, RewardFailure(
            reward=leaf.name, episode=episode, reason=reason, message=message, exception=exc
        )

    async def call() -> Any:
        if leaf.is_async:
            out = leaf.fn(prompt, completion, example)
        else:
            loop = asyncio.get_running_loop()
            out = await loop.run_in_executor(
                executor, functools.partial(leaf.fn, prompt, completion, example)
            )
        return await out if inspect.isawaitable(out) else out

    try:
        raw = await asyncio.wait_for(call(), timeout_s)
    except TimeoutError as exc:
        return failed("timeout", f"no result within {timeout_s} s", exc)
    except Exception as exc:  # any reward bug is reported through the policy, not a crash
        return failed("exception", f"{type(exc).__name__}: {exc}", exc)
    if raw is None or isinstance(raw, str | bytes):
        return failed("not_a_number", f"returned {type(raw).__name__} {raw!r:.80}")
    try:
        value = float(raw)
    except (TypeError, ValueError) as exc:
        return failed("not_a_number", f"returned {type(raw).__name__} {raw!r:.80}", exc)
    if math.isnan(value):
        return failed("nan", "returned NaN")
    if math.isinf(value):
        return failed("inf", f"returned {value}")
    return value, None
