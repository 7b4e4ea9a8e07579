"""Arithmetic word problems with a `calculator` tool; reward 1 for the right final number.

Problems are short and generated from a seed ("Tom has 12 apples and gets 35 more. How many apples
now?"), so a tiny model trained from scratch can learn both the tool call and the answer. The
calculator evaluates + - * / expressions by walking the Python AST (never `eval`), with limits on
length and magnitude.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import random
from typing import Literal

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


def calculator_tool(*, timeout_s: float = 2.0) -> Tool:
    def calculator(expression: str) -> str:
        return format_number(evaluate(expression))

    return Tool(
        calculator,
        name="calculator",
        description="Evaluate an arithmetic expression with + - * / and parentheses.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 + 35"}},
            "required": ["expression"],
        },
        timeout_s=timeout_s,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalculatorConfig:
    max_operand: int = 50
    ops: tuple[Op, ...] = ("+", "-")
    num_steps: int = 1  # operations per problem
    max_turns: int = 4
    eval_fraction: float = 0.1  # problems held out for evaluation (by a hash of the arithmetic)

    def __post_init__(self) -> None:
        owner = "CalculatorConfig"
        check_int(owner, "max_operand", self.max_operand, low=2)
        check(isinstance(self.eval_fraction, float) and 0.0 < self.eval_fraction < 1.0, owner,
              "eval_fraction", self.eval_fraction, "a float in (0, 1), exclusive")
        check(bool(self.ops) and all(op in _OPS for op in self.ops), owner, "ops", self.ops,
              f"a non-empty subset of {_OPS}")
        check(isinstance(self.num_steps, int) and 1 <= self.num_steps <= 4, owner, "num_steps",
              self.num_steps, "an int in [1, 4]")


def make_problem(rng: random.Random, config: CalculatorConfig) -> Task:
    """One word problem; every intermediate value is a non-negative integer."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    value = rng.randint(1, config.max_operand)
    expression, phrases = str(value), []
    for _ in range(config.num_steps):
        op = rng.choice(config.ops)
        if op == "-" and value < 1:
            op = "+"
        if op == "/":
            divisors = [d for d in range(2, min(value, config.max_operand) + 1) if value % d == 0]
            if not divisors:
                op = "+"
            else:
                b = rng.choice(divisors)
        if op == "-":
            b = rng.randint(1, value)
        elif op == "+":
            b = rng.randint(1, config.max_operand)
        elif op == "*":
            b = rng.randint(2, max(2, min(9, config.max_operand)))
        value = {"+": value + b, "-": value - b, "*": value * b, "/": value // b}[op]
        expression = f"({expression}) {op} {b}" if phrases else f"{expression} {op} {b}"
        phrases.append(_PHRASES[op].format(b=b))
    start = expression.lstrip("(").split(" ")[0].rstrip(")")
    prompt = f"{name} has {start} {item} and {', '.join(phrases)}. How many {item} now?"
    if len(phrases) > 1:
        prompt = (f"{name} has {start} {item}, {', '.join(phrases[:-1])} and {phrases[-1]}. "
                  f"How many {item} now?")  # fmt: skip
    return Task(prompt=prompt, answer=str(value), info={"expression": expression})


class CalculatorEnv(ToolEnvironment):
    system_prompt = "Use the calculator tool, then give the final number."

    def __init__(self, config: CalculatorConfig | None = None, *, tools: ToolSet | None = None):
        self.config = config or CalculatorConfig()
        super().__init__(
            tools=tools or ToolSet([calculator_tool()]),
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
        expression = task.info["expression"]
        call = ToolCall(name="calculator", arguments={"expression": expression}, id="call_0")
        return [
            Message.system(self.system_prompt),
            Message.user(task.prompt),
            Message.assistant(tool_calls=[call]),
            Message.tool(
                format_number(evaluate(expression)), tool_call_id="call_0", name="calculator"
            ),  # fmt: skip
            Message.assistant(task.answer),
        ]
