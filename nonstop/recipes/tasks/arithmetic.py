"""Multi-digit arithmetic, sized for tiny models: prompts like "12+35=", answers like "47".

Texts are short on purpose: a 2-4 layer model with a character vocabulary learns 2-digit addition
and subtraction to partial accuracy from SFT in minutes on a CPU, leaving room for RL to improve
it. Difficulty grows with `digits` (operands are drawn uniformly from [0, 10**digits)), `terms`
(operands per problem) and `ops` ("*" binds tighter, as usual). With `allow_negative=False`,
problems whose value is negative are redrawn. The reward is an exact match of the integer answer,
up to surrounding whitespace.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Literal, get_args

from nonstop.models.validation import check
from nonstop.recipes.tasks.base import GeneratedTask
from nonstop.recipes.tasks.expression import evaluate_expression
from nonstop.rl.rewards import Example, Reward, exact_match

ArithmeticOp = Literal["+", "-", "*"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticTask(GeneratedTask):
    """Integer arithmetic problems "a+b-c=" with the value as the answer."""

    digits: int = 2
    ops: tuple[ArithmeticOp, ...] = ("+", "-")
    terms: int = 2
    allow_negative: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = "ArithmeticTask"
        check(isinstance(self.digits, int) and 1 <= self.digits <= 9, owner, "digits",
              self.digits, "an int in [1, 9]")
        valid = get_args(ArithmeticOp)
        check(bool(self.ops) and all(op in valid for op in self.ops), owner, "ops", self.ops,
              f"a non-empty tuple of {valid}")
        check(isinstance(self.terms, int) and 2 <= self.terms <= 8, owner, "terms", self.terms,
              "an int in [2, 8]")

    @property
    def name(self) -> str:
        ops = "".join(sorted(self.ops))
        sign = "" if self.allow_negative else "_nonneg"
        return f"arithmetic_d{self.digits}_t{self.terms}_{ops}{sign}"

    @property
    def reward(self) -> Reward:
        return exact_match(name="arithmetic")

    def demonstration(self, example: Example) -> str:
        return example.answer

    def _generate(self, rng: random.Random) -> Example:
        for _ in range(10_000):
            operands = [rng.randrange(10**self.digits) for _ in range(self.terms)]
            ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
            expression = str(operands[0]) + "".join(
                f"{op}{x}" for op, x in zip(ops, operands[1:], strict=True)
            )
            value = evaluate_expression(expression, ops=self.ops).value
            if self.allow_negative or value >= 0:
                return Example(
                    prompt=f"{expression}=",
                    answer=str(int(value)),
                    metadata={"expression": expression, "value": int(value)},
                )
        raise RuntimeError(f"{self.name}: no non-negative problem in 10000 draws")
