"""Arithmetic word problems with a `calculator` tool; reward 1 for the right final number.

Problems are generated from a seed: a start value and `num_steps` operations told as a story
("Tom has 312 apples, gets 845 more and then has 3 times as many. How many apples now?"). The
default task is the small one the demo's tiny model learns on a CPU: one + or - step on
operands up to 50 (610 distinct problems at `max_operand=20`, `count_problems`).
`CalculatorConfig.wide()` is a real agentic problem: the four operations, start values and +, -
and / operands up to 1,000 (factors of * up to `max_factor`), two steps, and a calculator that
does one operation per call, so a correct episode is two tool calls, the second on the first
one's result, then the answer: over 10^9 distinct problems. The train/eval split is a hash of
the arithmetic, so a held-out sum is never trained on under other names. The calculator evaluates + - * /
expressions by walking the Python AST (never `eval`), with limits on length and magnitude.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import operator
import random
from typing import Any, Literal

from nonstop.agentic.environment import (
    Split,
    Task,
    ToolEnvironment,
    draw_in_split,
    numeric_reward,
)
from nonstop.agentic.tools import Tool, ToolSet
from nonstop.models.chat import Message, ToolCall
from nonstop.models.validation import check, check_int

Op = Literal["+", "-", "*", "/"]
_OPS: tuple[Op, ...] = ("+", "-", "*", "/")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}  # fmt: skip
_MAX_EXPRESSION_CHARS = 200
_MAX_MAGNITUDE = 1e15

_NAMES = ("Tom", "Ann", "Bo", "Eva", "Max", "Lea", "Sam", "Ida")
_ITEMS = ("apples", "pens", "cards", "eggs", "books", "coins", "shells", "stamps")
_PHRASES: dict[Op, str] = {
    "+": "gets {b} more",
    "-": "gives away {b}",
    "*": "then has {b} times as many",
    "/": "then keeps one of {b} equal shares",
}


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression of numbers, + - * / and parentheses."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {error.msg}") from None

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            value = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = -walk(node.operand) if isinstance(node.op, ast.USub) else walk(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            value = _BINARY[type(node.op)](left, right)
        else:
            raise ValueError(f"unsupported syntax: {type(node).__name__}")
        if abs(value) > _MAX_MAGNITUDE:
            raise ValueError("number too large")
        return value

    return walk(tree)


def format_number(value: float) -> str:
    """Integers without a decimal point, others rounded to 6 places."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


def count_operations(expression: str) -> int:
    """How many binary operations (+ - * /) an expression has; ValueError if it does not parse."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {error.msg}") from None
    return sum(isinstance(node, ast.BinOp) for node in ast.walk(tree))


def calculator_tool(*, timeout_s: float = 2.0, ops_per_call: int | None = None) -> Tool:
    """The `calculator(expression)` tool; with `ops_per_call`, an expression with more
    operations is refused (the model must compute step by step, one call per step)."""

    def calculator(expression: str) -> str:
        if len(expression) <= _MAX_EXPRESSION_CHARS and ops_per_call is not None:
            n = count_operations(expression)
            if n > ops_per_call:
                raise ValueError(f"{n} operations in one call; this calculator does "
                                 f"{ops_per_call} per call: call it once per step")
        return format_number(evaluate(expression))

    what = "one operation" if ops_per_call == 1 else f"up to {ops_per_call} operations"
    return Tool(
        calculator,
        name="calculator",
        description=("Evaluate an arithmetic expression with + - * / and parentheses."
                     if ops_per_call is None else
                     f"Evaluate {what} (+ - * /) on numbers, e.g. 12 + 35."),
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 + 35"}},
            "required": ["expression"],
        },
        timeout_s=timeout_s,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalculatorConfig:
    max_operand: int = 50  # start values and the operands of +, - and /
    max_factor: int = 9  # the factors of *
    ops: tuple[Op, ...] = ("+", "-")
    num_steps: int = 1  # operations per problem
    ops_per_call: int | None = None  # operations the calculator takes in one call (None: any)
    max_turns: int = 4
    eval_fraction: float = 0.1  # problems held out for evaluation (by a hash of the arithmetic)

    @classmethod
    def wide(cls, **overrides: Any) -> CalculatorConfig:
        """The wide task: + - * /, operands up to 1,000, two steps, one operation per call."""
        return cls(**{"max_operand": 1000, "ops": _OPS, "num_steps": 2, "ops_per_call": 1,
                      **overrides})

    def __post_init__(self) -> None:
        owner = "CalculatorConfig"
        check_int(owner, "max_operand", self.max_operand, low=2)
        check_int(owner, "max_factor", self.max_factor, low=2)
        check(bool(self.ops) and all(op in _OPS for op in self.ops), owner, "ops", self.ops,
              f"a non-empty subset of {_OPS}")
        check(isinstance(self.num_steps, int) and 1 <= self.num_steps <= 4, owner, "num_steps",
              self.num_steps, "an int in [1, 4]")
        if self.ops_per_call is not None:
            check_int(owner, "ops_per_call", self.ops_per_call)
        calls = self.calls_needed()
        check_int(owner, "max_turns", self.max_turns, low=calls + 1)
        check(isinstance(self.eval_fraction, float) and 0.0 < self.eval_fraction < 1.0, owner,
              "eval_fraction", self.eval_fraction, "a float in (0, 1), exclusive")

    def calls_needed(self) -> int:
        """Calculator calls a problem of `num_steps` operations needs, one call per turn."""
        per_call = self.ops_per_call or self.num_steps
        return -(-self.num_steps // per_call)


def make_problem(rng: random.Random, config: CalculatorConfig) -> Task:
    """One word problem; every intermediate value is a non-negative integer. `info` holds the
    whole `expression`, the `start` value and the `steps`, one (operation, operand) each."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    start = value = rng.randint(1, config.max_operand)
    steps = []
    for _ in range(config.num_steps):
        op, b = _operation(rng, config, value)
        steps.append((op, b))
        value = _apply(op, value, b)
    phrases = [_PHRASES[op].format(b=b) for op, b in steps]
    if len(phrases) > 1:
        prompt = (f"{name} has {start} {item}, {', '.join(phrases[:-1])} and {phrases[-1]}. "
                  f"How many {item} now?")  # fmt: skip
    else:
        prompt = f"{name} has {start} {item} and {phrases[0]}. How many {item} now?"
    return Task(prompt=prompt, answer=str(value),
                info={"expression": _expression(start, steps), "start": start,
                      "steps": tuple(steps)})  # fmt: skip


def _expression(start: int, steps: list[tuple[Op, int]] | tuple[tuple[Op, int], ...]) -> str:
    """'(start op b) op c ...': the steps applied left to right."""
    expression = str(start)
    for i, (op, b) in enumerate(steps):
        expression = f"({expression}) {op} {b}" if i else f"{expression} {op} {b}"
    return expression


def solution_calls(task: Task, config: CalculatorConfig) -> list[tuple[str, int]]:
    """The calculator calls that solve `task`, `config.ops_per_call` operations each, every
    call starting from the previous result: (expression, its value) per call."""
    steps = [tuple(step) for step in task.info["steps"]]
    per_call = config.ops_per_call or len(steps)
    value, calls = int(task.info["start"]), []
    for i in range(0, len(steps), per_call):
        chunk = steps[i : i + per_call]
        expression = _expression(value, chunk)
        for op, b in chunk:
            value = _apply(op, value, b)
        calls.append((expression, value))
    return calls


def _options(config: CalculatorConfig, value: int) -> dict[Op, range | list[int]]:
    """The operands each operation may take at `value` (empty: not possible there)."""
    return {
        "+": range(1, config.max_operand + 1),
        "-": range(1, value + 1),
        "*": range(2, config.max_factor + 1),
        "/": [d for d in range(2, min(value, config.max_operand) + 1) if value % d == 0],
    }


def _operation(rng: random.Random, config: CalculatorConfig, value: int) -> tuple[Op, int]:
    """An operation and its operand at `value`; one that cannot apply there (- at 0, / of a
    value with no divisor in range) becomes a +."""
    op = rng.choice(config.ops)
    if op == "/":  # divisors only: every value stays an integer
        divisors = _options(config, value)["/"]
        if divisors:
            return op, rng.choice(divisors)
        op = "+"
    if op == "-" and value >= 1:
        return op, rng.randint(1, value)
    if op == "*":
        return op, rng.randint(2, config.max_factor)
    return "+", rng.randint(1, config.max_operand)


def _apply(op: Op, a: int, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]


def count_problems(config: CalculatorConfig) -> int:
    """How many distinct arithmetic problems (start value and operations; names and items
    aside) `make_problem` can draw under `config`: paths through the values reachable."""
    paths = collections.Counter(range(1, config.max_operand + 1))  # value -> problems ending there
    for _ in range(config.num_steps - 1):
        following: collections.Counter[int] = collections.Counter()
        for value, n in paths.items():
            options = _options(config, value)
            for op in config.ops:
                for b in options[op]:
                    following[_apply(op, value, b)] += n
        paths = following
    return sum(n * sum(len(_options(config, value)[op]) for op in config.ops)
               for value, n in paths.items())


class CalculatorEnv(ToolEnvironment):
    system_prompt = "Use the calculator tool, then give the final number."

    def __init__(self, config: CalculatorConfig | None = None, *, tools: ToolSet | None = None):
        self.config = config or CalculatorConfig()
        super().__init__(
            tools=tools or ToolSet([calculator_tool(ops_per_call=self.config.ops_per_call)]),
            reward_fn=numeric_reward,
            max_turns=self.config.max_turns,
        )

    def sample_task(self, seed: int, split: Split = "train") -> Task:
        """A problem of `split`: the split is a hash of its arithmetic (names and items aside),
        so no evaluation sum is ever trained on under another name."""
        return draw_in_split(lambda rng: make_problem(rng, self.config), random.Random(seed),
                             split, self.config.eval_fraction, owner="CalculatorEnv",
                             key=lambda task: task.info["expression"])

    def demonstration(self, task: Task) -> list[Message]:
        """One calculator call per turn (`ops_per_call` operations each, the first from the
        start value, each next one from the result before), then the final number."""
        messages = [Message.system(self.system_prompt), Message.user(task.prompt)]
        for i, (expression, value) in enumerate(solution_calls(task, self.config)):
            call = ToolCall(name="calculator", arguments={"expression": expression}, id=f"call_{i}")
            messages += [Message.assistant(tool_calls=[call]),
                         Message.tool(format_number(value), tool_call_id=call.id,
                                      name="calculator")]  # fmt: skip
        return messages + [Message.assistant(task.answer)]
