"""Reading final answers out of completions, and deciding whether two math answers are equal.

`extract_answer` finds the answer a completion commits to: the last `\\boxed{...}`, else the text
after the last marker (GSM8K's `####`), else what follows "the answer is", else the last number.
`parse_number` reads one number ("1,234", "-0.5", "3/4", "\\frac{3}{4}", "50%", "$12").

`math_equal` decides equivalence ("0.5" vs "\\frac{1}{2}", "2x+2" vs "2(x+1)") with the
`math-verify` package when it is installed, else with SymPy. The SymPy path never calls `eval` or
`sympy.sympify` on model text (both execute code): it parses with `ast`, admits only numbers, a few
named constants and functions, single-letter variables and arithmetic, and refuses exponents large
enough to stall the host.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import re
import threading
from collections.abc import Callable
from typing import Any, Literal

MathBackend = Literal["auto", "math_verify", "sympy"]

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
# A number not glued to a preceding word, digit or dot: "12-5" yields 12 and 5, not -5.
_NUMBER_IN_TEXT = re.compile(rf"(?<![\w.])(?:{_NUMBER})")
_WHOLE_NUMBER = re.compile(rf"(?:{_NUMBER})")
_FRAC = re.compile(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*([^\n]+)", re.IGNORECASE)
_THOUSANDS = re.compile(r"(\d),(\d{3})(?!\d)")
_MAX_EXPR_CHARS = 256
_MAX_EXPONENT = 1000


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unbalanced: the model stopped mid-answer


def last_number(text: str) -> str | None:
    """The last number written in `text` ("1,234.5", "-3", "3/4"), as written; None if none."""
    found = _NUMBER_IN_TEXT.findall(text)
    return found[-1] if found else None


def extract_answer(text: str, *, marker: str | None = "####") -> str | None:
    """The answer `text` commits to: boxed, else after the last `marker`, else after "answer is",
    else the last number. None when none of these is present."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    if marker and marker in text:
        after = text.rsplit(marker, 1)[1].strip().split("\n", 1)[0].strip()
        if after:
            return after
    said = _ANSWER_IS.findall(text)
    if said:
        return said[-1].strip().rstrip(".").strip()
    return last_number(text)


def parse_number(text: str) -> float | None:
    """`text` read as one number, or None. Accepts thousands commas, a sign, decimals, `a/b`,
    `\\frac{a}{b}`, a leading `$` and a trailing `%` or full stop (both dropped)."""
    s = text.strip().replace("\\$", "$").replace("\\%", "%").replace("\\!", "")
    s = s.strip("$ ").rstrip(".").rstrip("%").strip()
    frac = _FRAC.fullmatch(s)
    if frac is not None:
        sign, num, den = frac.groups()
        return None if int(den) == 0 else (-1 if sign else 1) * int(num) / int(den)
    if _WHOLE_NUMBER.fullmatch(s) is None:
        return None
    s = s.replace(",", "")
    if "/" in s:
        num, den = s.split("/")
        return None if float(den) == 0 else float(num) / float(den)
    return float(s)


def number_in(text: str) -> float | None:
    """`text` as a number, else the last number inside it ("72 clips" -> 72.0); None if none."""
    value = parse_number(text)
    if value is None:
        found = last_number(text)
        value = parse_number(found) if found is not None else None
    return value


# ---------------------------------------------------------------------------------- equivalence


def resolve_math_backend(backend: MathBackend) -> Literal["math_verify", "sympy"]:
    """The backend `math_equal` will use; ImportError naming what to install if none is present."""
    have_mv = importlib.util.find_spec("math_verify") is not None
    have_sympy = importlib.util.find_spec("sympy") is not None
    if backend == "math_verify" and not have_mv:
        raise ImportError(
            "backend='math_verify' needs the math-verify package: pip install 'nonstop[math]'"
        )
    if backend == "sympy" and not have_sympy:
        raise ImportError("backend='sympy' needs SymPy: pip install 'nonstop[math]'")
    if backend == "auto":
        if have_mv:
            return "math_verify"
        if have_sympy:
            return "sympy"
        raise ImportError(
            "math answer checking needs math-verify or SymPy (pip install 'nonstop[math]'); "
            "neither is installed"
        )
    if backend not in ("math_verify", "sympy"):
        raise ValueError(
            f"backend = {backend!r} is not valid; use 'auto', 'math_verify' or 'sympy'"
        )
    return backend


def math_equal(
    gold: str, pred: str, *, backend: MathBackend = "auto", tolerance: float = 1e-6
) -> bool:
    """Whether answer `pred` is mathematically equal to `gold` (both answer strings, not whole
    completions). Numbers compare with relative `tolerance`; expressions by simplification."""
    if resolve_math_backend(backend) == "math_verify":
        return _math_verify_equal(gold, pred)
    a, b = to_sympy(gold), to_sympy(pred)
    if a is None or b is None:
        return False
    return _sympy_equal(a, b, tolerance)


def _math_verify_equal(gold: str, pred: str) -> bool:
    import math_verify

    # math-verify times out with SIGALRM, which only works on the main thread; rewards normally
    # run in a worker thread, where the expression-size limits of math-verify itself apply.
    main = threading.current_thread() is threading.main_thread()
    kw_parse: dict[str, Any] = {} if main else {"parsing_timeout": None}
    kw_verify: dict[str, Any] = {} if main else {"timeout_seconds": None}
    gold_parsed = math_verify.parse(f"${gold}$", **kw_parse)
    pred_parsed = math_verify.parse(f"${pred}$", **kw_parse)
    return bool(math_verify.verify(gold_parsed, pred_parsed, **kw_verify))


def _sympy_equal(a: Any, b: Any, tolerance: float) -> bool:
    import sympy

    if isinstance(a, tuple) or isinstance(b, tuple):
        if not (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)):
            return False
        return all(_sympy_equal(x, y, tolerance) for x, y in zip(a, b, strict=True))
    try:
        diff = a - b
        if diff == 0:
            return True
        if not (a.free_symbols or b.free_symbols):
            d, ref = complex(sympy.N(diff)), complex(sympy.N(a))
            return math.isfinite(abs(d)) and abs(d) <= tolerance * max(1.0, abs(ref))
        return bool(sympy.simplify(diff) == 0)
    except (TypeError, ValueError, ArithmeticError, AttributeError):
        return False


def _latex_to_plain(text: str) -> str | None:
    s = text.strip().strip("$").strip()
    s = re.sub(r"\\(?:text|mathrm|textbf|mbox)\{[^{}]*\}", "", s)  # units and words
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""),
                     ("\\ ", ""), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("%", ""),
                     ("\\$", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\cdot", "*"),
                     ("\\times", "*"), ("\\div", "/"), ("\\pi", " pi "), ("\\infty", " oo ")):  # fmt: skip
        s = s.replace(old, new)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = _replace_braced(s, "\\frac", 2, lambda a: f"(({a[0]})/({a[1]}))")
    s = _replace_braced(s, "\\sqrt", 1, lambda a: f"sqrt({a[0]})")
    if s is None or "\\" in s:
        return None
    if "=" in s:
        s = s.rsplit("=", 1)[1]
    while _THOUSANDS.search(s):
        s = _THOUSANDS.sub(r"\1\2", s)
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    s = re.sub(r"(\d)\s*([A-Za-z(])", r"\1*\2", s)  # implicit products: 2x, 3(x+1)
    s = re.sub(r"\)\s*([\w(])", r")*\1", s)
    return s.strip() or None


def _replace_braced(s: str | None, command: str, n_args: int, build: Callable) -> str | None:
    """Replace `command{a}{b}` (balanced braces, innermost first) by `build([a, b])`."""
    while s is not None and command + "{" in s:
        start = s.rfind(command + "{")
        args, i = [], start + len(command)
        for _ in range(n_args):
            if i >= len(s) or s[i] != "{":
                return None
            depth, j = 0, i
            while j < len(s):
                depth += {"{": 1, "}": -1}.get(s[j], 0)
                if depth == 0:
                    break
                j += 1
            if j == len(s):
                return None
            args.append(s[i + 1 : j])
            i = j + 1
        s = s[:start] + build(args) + s[i:]
    return s


def to_sympy(text: str) -> Any:
    """A SymPy expression (or a tuple of them for "a, b") for an answer string, built from a
    restricted `ast` walk, never `eval`; None if `text` is not a plain math answer."""
    plain = _latex_to_plain(text)
    if plain is None or len(plain) > _MAX_EXPR_CHARS:
        return None
    try:
        tree = ast.parse(plain, mode="eval")
        return _SympyBuilder().build(tree.body)
    except (SyntaxError, ValueError, TypeError, ArithmeticError, RecursionError, MemoryError):
        return None


class _SympyBuilder:
    _FUNCS = ("sqrt", "log", "ln", "exp", "sin", "cos", "tan", "abs")

    def __init__(self) -> None:
        import sympy

        self.sp = sympy
        self.nodes = 0

    def build(self, node: ast.AST) -> Any:
        self.nodes += 1
        if self.nodes > 200:
            raise ValueError("expression too large")
        sp = self.sp
        if isinstance(node, ast.Tuple):
            return tuple(self.build(e) for e in node.elts)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return (
                sp.Integer(node.value) if type(node.value) is int else sp.Rational(repr(node.value))
            )
        if isinstance(node, ast.Name):
            named = {"pi": sp.pi, "oo": sp.oo, "e": sp.E}
            if node.id in named:
                return named[node.id]
            if len(node.id) == 1:
                return sp.Symbol(node.id)
            raise ValueError(f"unknown name {node.id!r}")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            value = self.build(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp):
            left, right = self.build(node.left), self.build(node.right)
            op = type(node.op)
            if op is ast.Add:
                return left + right
            if op is ast.Sub:
                return left - right
            if op is ast.Mult:
                return left * right
            if op is ast.Div:
                return left / right
            if op is ast.Pow:
                if right.is_number and not (abs(sp.N(right)) <= _MAX_EXPONENT):
                    raise ValueError("exponent too large")
                return left**right
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in self._FUNCS
            and len(node.args) == 1
            and not node.keywords
        ):
            arg = self.build(node.args[0])
            fn = {"ln": sp.log, "abs": sp.Abs}.get(node.func.id) or getattr(sp, node.func.id)
            return fn(arg)
        raise ValueError(f"{type(node).__name__} is not allowed in a math answer")
