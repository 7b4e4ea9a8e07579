"""A safe evaluator for integer arithmetic written by a model: `+ - * /`, parentheses, nothing else.

Model text is never passed to `eval`. It is first checked character by character (digits, the four
operators, parentheses, spaces), then parsed with `ast` and walked: only integer literals and the
allowed binary operators are accepted, so names, calls, attributes, `**`, `//`, unary signs, hex or
underscore literals and anything else are rejected with the reason. Arithmetic is exact
(`fractions.Fraction`); division by zero and, if asked, non-integer intermediate values are errors.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Literal

Operator = Literal["+", "-", "*", "/"]
OPERATORS: tuple[Operator, ...] = ("+", "-", "*", "/")
PRECEDENCE: dict[str, int] = {"+": 1, "-": 1, "*": 2, "/": 2}

_ALLOWED_CHARS = re.compile(r"[0-9+\-*/() \t]*")
_AST_OPS: dict[type[ast.operator], Operator] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
}
MAX_EXPRESSION_CHARS = 200


class ExpressionError(ValueError):
    """The text is not an allowed expression, or evaluating it is undefined."""


@dataclasses.dataclass(frozen=True)
class Evaluated:
    """An expression's exact value and the integer literals it used, left to right."""

    value: Fraction
    numbers: tuple[int, ...]


def evaluate_expression(
    text: str,
    *,
    ops: Sequence[Operator] = OPERATORS,
    integer_intermediates: bool = False,
) -> Evaluated:
    """Evaluate `text` exactly; ExpressionError (with the reason) if it is not allowed."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    if _ALLOWED_CHARS.fullmatch(text) is None:
        bad = sorted({c for c in text if _ALLOWED_CHARS.fullmatch(c) is None})
        raise ExpressionError(f"characters {''.join(bad)!r} are not allowed")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExpressionError(f"not an arithmetic expression: {exc}") from None
    numbers: list[int] = []
    value = _walk(tree.body, frozenset(ops), integer_intermediates, numbers)
    return Evaluated(value=value, numbers=tuple(numbers))


def _walk(node: ast.AST, ops: frozenset[str], integer_only: bool, numbers: list[int]) -> Fraction:
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:
            raise ExpressionError(f"literal {node.value!r} is not an integer")
        numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        op = _AST_OPS.get(type(node.op))
        if op is None or op not in ops:
            raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
        left = _walk(node.left, ops, integer_only, numbers)
        right = _walk(node.right, ops, integer_only, numbers)
        if op == "+":
            value = left + right
        elif op == "-":
            value = left - right
        elif op == "*":
            value = left * right
        else:
            if right == 0:
                raise ExpressionError("division by zero")
            value = left / right
        if integer_only and value.denominator != 1:
            raise ExpressionError(f"non-integer intermediate value {value}")
        return value
    if isinstance(node, ast.UnaryOp):
        raise ExpressionError("unary signs are not allowed")
    raise ExpressionError(f"{type(node).__name__} is not allowed")


def combine(left: tuple[str, int], op: Operator, right: tuple[str, int]) -> tuple[str, int]:
    """Join two (text, precedence) operands with `op`, adding only the parentheses it needs.
    Atoms have precedence 3."""
    level = PRECEDENCE[op]
    ltext, lprec = left
    rtext, rprec = right
    if lprec < level:
        ltext = f"({ltext})"
    if rprec < level or (rprec == level and op in ("-", "/")):
        rtext = f"({rtext})"
    return f"{ltext}{op}{rtext}", level
