"""Countdown: combine the given numbers with + - * / to reach a target ("Make 16 from 3,5,2:").

Every problem is solvable: the target is the value of a random expression over the numbers, which
is also the demonstration. A completion is correct when its expression (the last `<answer>...`
block if there is one; anything after an "=" is ignored) uses the given numbers — each exactly
once with `use_all`, else at most once — and evaluates exactly to the target. Expressions are
checked by `expression.evaluate_expression`, never `eval`. With `integer_intermediates` (the
classic rule) every intermediate value must be an integer; unary minus is not allowed.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import re
from collections.abc import Sequence
from fractions import Fraction

from nonstop.models.validation import check
from nonstop.recipes.tasks.base import GeneratedTask
from nonstop.recipes.tasks.expression import (
    OPERATORS,
    ExpressionError,
    Operator,
    combine,
    evaluate_expression,
)
from nonstop.rl.rewards import Example, Reward

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class CountdownVerdict:
    """Whether a countdown answer is correct, and if not, why."""

    correct: bool
    reason: str


def check_countdown(
    completion: str,
    numbers: Sequence[int],
    target: int,
    *,
    use_all: bool = True,
    integer_intermediates: bool = True,
    ops: Sequence[Operator] = OPERATORS,
) -> CountdownVerdict:
    """Judge `completion` as an answer to "make `target` from `numbers`"."""
    tagged = _ANSWER_TAG.findall(completion)
    text = tagged[-1] if tagged else completion
    text = text.split("=", 1)[0].strip()
    if not text:
        return CountdownVerdict(False, "no expression")
    try:
        result = evaluate_expression(text, ops=ops, integer_intermediates=integer_intermediates)
    except ExpressionError as exc:
        return CountdownVerdict(False, str(exc))
    given, used = collections.Counter(numbers), collections.Counter(result.numbers)
    extra = used - given
    if extra:
        return CountdownVerdict(False, f"uses {sorted(extra.elements())} beyond the numbers given")
    if use_all and used != given:
        return CountdownVerdict(False, f"leaves {sorted((given - used).elements())} unused")
    if result.value != target:
        return CountdownVerdict(False, f"evaluates to {result.value}, not {target}")
    return CountdownVerdict(True, "correct")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountdownTask(GeneratedTask):
    """`numbers` integers from [1, max_number] and a target in [min_target, max_target]."""

    numbers: int = 3
    max_number: int = 20
    min_target: int = 1
    max_target: int = 100
    ops: tuple[Operator, ...] = OPERATORS
    use_all: bool = True
    integer_intermediates: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = "CountdownTask"
        check(2 <= self.numbers <= 6, owner, "numbers", self.numbers, "an int in [2, 6]")
        check(self.max_number >= 1, owner, "max_number", self.max_number, "an int >= 1")
        check(bool(self.ops) and all(op in OPERATORS for op in self.ops), owner, "ops", self.ops,
              f"a non-empty tuple of {OPERATORS}")
        check(0 <= self.min_target <= self.max_target, owner, "min_target", self.min_target,
              f"an int in [0, max_target={self.max_target}]")

    @property
    def name(self) -> str:
        return f"countdown_n{self.numbers}_m{self.max_number}_t{self.min_target}-{self.max_target}"

    @property
    def reward(self) -> Reward:
        use_all, integer, ops = self.use_all, self.integer_intermediates, self.ops

        def score(prompt: str, completion: str, example: Example) -> float:
            verdict = check_countdown(
                completion,
                example.metadata["numbers"],
                example.metadata["target"],
                use_all=use_all,
                integer_intermediates=integer,
                ops=ops,
            )
            return float(verdict.correct)

        return Reward("countdown", score)

    def demonstration(self, example: Example) -> str:
        return example.metadata["solution"]

    def _generate(self, rng: random.Random) -> Example:
        for _ in range(10_000):
            numbers = [rng.randint(1, self.max_number) for _ in range(self.numbers)]
            built = self._random_expression(numbers, rng)
            if built is None:
                continue
            solution, value = built
            if value.denominator == 1 and self.min_target <= value <= self.max_target:
                target = int(value)
                shown = ",".join(map(str, numbers))
                return Example(
                    prompt=f"Make {target} from {shown}:",
                    answer=str(target),
                    metadata={"numbers": tuple(numbers), "target": target, "solution": solution},
                )
        raise RuntimeError(f"{self.name}: no problem with a target in range in 10000 draws")

    def _random_expression(
        self, numbers: list[int], rng: random.Random
    ) -> tuple[str, Fraction] | None:
        """Combine random pairs until one expression is left; None on a dead end."""
        items: list[tuple[str, int, Fraction]] = [(str(n), 3, Fraction(n)) for n in numbers]
        while len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            (lt, lp, lv), (rt, rp, rv) = items[i], items[j]
            results = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv / rv if rv else None}
            allowed = [
                op
                for op in self.ops
                if results[op] is not None
                and not (self.integer_intermediates and results[op].denominator != 1)
            ]
            if not allowed:
                return None
            op = rng.choice(allowed)
            value = results[op]
            text, prec = combine((lt, lp), op, (rt, rp))
            items = [it for k, it in enumerate(items) if k not in (i, j)] + [(text, prec, value)]
        return items[0][0], items[0][2]
