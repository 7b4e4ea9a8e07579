"""A user's environment, tools and reward, named by import path in a config.

    env:
      tools: ["my_pkg.tools:search", "my_pkg.tools:fetch"]   # plain functions, sync or async
      reward: "my_pkg.rewards:score"                          # (prompt, completion, example)
    env:
      path: "my_pkg.envs:MyEnv"                               # an Environment class or factory
      args: {difficulty: 3}

`import_object` resolves `module:attribute` (dots after the colon walk attributes). A function
becomes a `Tool` whose JSON schema comes from its type hints and whose descriptions come from its
docstring (first paragraph: the tool; Google-style `Args:` or Sphinx `:param x:` lines: each
parameter). A reward is a callable `(prompt, completion, example) -> float`, sync or async, the
convention of `nonstop.rl.rewards`; `reward_on_thread` runs a sync one in a worker thread so a
slow reward (an HTTP call, a judge) never stalls the event loop that drives the other episodes.

Every problem — a module that does not import, a missing attribute, an object of the wrong kind,
a parameter whose schema cannot be derived — is one line, a `ConfigError` naming the config key
(`invalid(owner, field, value, why)`), raised while the config is loaded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import importlib
import inspect
import re
import types
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal

from nonstop.agentic.environment import Environment, Task, ToolEnvironment
from nonstop.agentic.tools import Tool, ToolSet
from nonstop.models.validation import invalid
from nonstop.rl.rewards import Example, Reward

_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class SchemaError(ValueError):
    """A function whose tool schema cannot be derived (the message says which parameter)."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def import_object(value: Any, *, owner: str, field: str) -> Any:
    """The object `value` ("package.module:attribute") names; a ConfigError on `owner.field`
    when it is not such a string, its module does not import, or the attribute is missing."""
    if not isinstance(value, str) or not _PATH.match(value):
        raise invalid(owner, field, value,
                      "an import path 'package.module:attribute' (e.g. 'my_pkg.tools:search')")
    module_name, _, attributes = value.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's module
        raise invalid(owner, field, value, f"an importable module; importing {module_name!r} "
                      f"raised {type(error).__name__}: {_one_line(error)}") from None
    walked = module_name
    for name in attributes.split("."):
        if not hasattr(obj, name):
            raise invalid(owner, field, value,
                          f"an attribute that exists; {walked} has no attribute {name!r}")
        obj, walked = getattr(obj, name), f"{walked}.{name}"
    return obj


# ------------------------------------------------------------------------------ tool schemas


_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean",
           type(None): "null"}


def _type_schema(tp: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one annotation (the subset `nonstop.agentic.tools` validates)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp in _SIMPLE:
        return {"type": _SIMPLE[tp]}
    if origin is Literal:
        kinds = {_SIMPLE.get(type(a)) for a in args}
        if None in kinds or len(kinds) != 1:
            raise SchemaError(f"{where}: Literal values must all be str, int, float or bool")
        return {"type": kinds.pop(), "enum": list(args)}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _type_schema(Literal[tuple(m.value for m in tp)], where)  # type: ignore[misc]
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) != 1:
            raise SchemaError(f"{where}: a union other than `X | None` has no tool schema; "
                              "use one type")
        schema = _type_schema(members[0], where)
        if len(members) < len(args):
            schema["type"] = [schema["type"], "null"]
        return schema
    if tp in (list, tuple) or origin in (list, tuple, Sequence, typing.Sequence):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise SchemaError(f"{where}: a fixed-length tuple has no tool schema; use "
                              "tuple[X, ...] or list[X]")
        return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
    if tp in (dict, Mapping) or origin in (dict, Mapping, typing.Mapping):
        if args and args[0] is not str:
            raise SchemaError(f"{where}: object keys are strings; use dict[str, X]")
        return {"type": "object"}
    raise SchemaError(f"{where}: type {getattr(tp, '__name__', tp)!r} has no tool schema; use "
                      "str, int, float, bool, a Literal, an Enum, list[X], dict[str, X] or "
                      "X | None")


def _docstring(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The description (first paragraph) and per-parameter descriptions of `fn`'s docstring."""
    doc = inspect.getdoc(fn) or ""
    description = " ".join(doc.split("\n\n")[0].split())
    params: dict[str, str] = {}
    for name, text in re.findall(r"^\s*:param\s+(?:[^:]*\s)?(\w+):\s*(.+)$", doc, re.M):
        params[name] = text.strip()
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?|\s*\n)+)", doc,
                        re.M)
    if section:
        current = None
        for line in section.group(1).splitlines():
            entry = re.match(r"^\s{0,8}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if entry:
                current = entry.group(1)
                params[current] = entry.group(2).strip()
            elif current and line.strip():
                params[current] = f"{params[current]} {line.strip()}".strip()
    return description, params


def function_schema(fn: Callable[..., Any]) -> tuple[str, dict[str, Any]]:
    """`fn`'s description and its parameters as a JSON schema of type object; SchemaError
    naming what cannot be derived (no docstring, a parameter without a type, *args, ...)."""
    name = getattr(fn, "__name__", type(fn).__name__)
    description, documented = _docstring(fn)
    if not description:
        raise SchemaError(f"{name} has no docstring; its first paragraph is the tool's "
                          "description the model reads")
    try:
        hints = typing.get_type_hints(fn)
        signature = inspect.signature(fn)
    except Exception as error:  # noqa: BLE001 - unresolvable annotations, builtins
        raise SchemaError(f"the type hints of {name} cannot be resolved "
                          f"({type(error).__name__}: {_one_line(error)})") from None
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in signature.parameters.values():
        where = f"parameter {param.name!r} of {name}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise SchemaError(f"{where}: tools are called with keyword arguments; *args, "
                              "**kwargs and positional-only parameters have no schema")
        if param.name not in hints:
            raise SchemaError(f"{where} has no type annotation")
        schema = _type_schema(hints[param.name], where)
        if param.name in documented:
            schema["description"] = documented[param.name]
        properties[param.name] = schema
        if param.default is param.empty:
            required.append(param.name)
    parameters = {"type": "object", "properties": properties, "required": required,
                  "additionalProperties": False}
    return description, parameters


def tool_from_function(fn: Callable[..., Any], *, timeout_s: float = 10.0) -> Tool:
    """A `Tool` running `fn` (sync in the ToolSet's threads, async on the loop), its schema
    derived by `function_schema`."""
    description, parameters = function_schema(fn)
    return Tool(fn, name=fn.__name__, description=description, parameters=parameters,
                timeout_s=timeout_s)


def load_tool(value: str, *, owner: str, field: str, timeout_s: float = 10.0) -> Tool:
    """The tool at import path `value`: a `Tool`, or a function made into one."""
    obj = import_object(value, owner=owner, field=field)
    if isinstance(obj, Tool):
        return obj
    if not inspect.isfunction(obj) and not inspect.ismethod(obj):
        raise invalid(owner, field, value, "a path to a Python function (sync or async) or a "
                      f"nonstop Tool; it names a {type(obj).__name__}")
    try:
        return tool_from_function(obj, timeout_s=timeout_s)
    except SchemaError as error:
        raise invalid(owner, field, value, f"a function with a derivable tool schema; {error}"
                      ) from None
    except ValueError as error:  # Tool's own checks (its name)
        raise invalid(owner, field, value, _one_line(error)) from None


# ------------------------------------------------------------------------------ rewards


def _takes_positional(fn: Callable[..., Any], count: int) -> bool:
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins): let the call decide
        return True
    return True


def load_reward(value: str, *, owner: str, field: str) -> Reward:
    """The reward at import path `value`: a `Reward`, or a callable (prompt, completion,
    example) -> float (or an awaitable of one) wrapped in a Reward named after it."""
    obj = import_object(value, owner=owner, field=field)
    if isinstance(obj, Reward):
        return obj
    if not callable(obj) or isinstance(obj, type):
        raise invalid(owner, field, value, "a path to a reward function (prompt, completion, "
                      f"example) -> float; it names a {type(obj).__name__}")
    if not _takes_positional(obj, 3):
        raise invalid(owner, field, value, "a reward function taking three arguments (prompt, "
                      f"completion, example); {value} has the signature "
                      f"{inspect.signature(obj)}")
    name = getattr(obj, "__name__", "reward").replace("/", "_")
    return Reward(name, obj)


def reward_on_thread(reward: Reward) -> Callable[[str, str, Example], Awaitable[float]]:
    """`reward` as a coroutine function: an async reward awaited, a sync one run in a worker
    thread (`asyncio.to_thread`), so the event loop keeps serving other episodes meanwhile."""

    async def score(prompt: str, completion: str, example: Example) -> float:
        if reward.is_async:
            value = reward(prompt, completion, example)
            return float(await value if inspect.isawaitable(value) else value)  # type: ignore[arg-type]
        value = await asyncio.to_thread(reward, prompt, completion, example)
        if inspect.isawaitable(value):  # a callable object returning a coroutine
            value = await value
        return float(value)  # type: ignore[arg-type]

    return score


# ------------------------------------------------------------------------------ environments


def check_environment(obj: Any, args: Mapping[str, Any], *, owner: str, field: str,
                      value: str) -> None:
    """`obj` must be an Environment subclass or a factory function, and `args` must fit its
    signature as keyword arguments."""
    if isinstance(obj, type):
        if not issubclass(obj, Environment):
            raise invalid(owner, field, value, "a nonstop Environment subclass or a function "
                          f"returning one; {obj.__name__} is not an Environment")
        if inspect.isabstract(obj):
            missing = ", ".join(sorted(obj.__abstractmethods__))
            raise invalid(owner, field, value, f"a concrete Environment; {obj.__name__} does "
                          f"not implement {missing}")
    elif not callable(obj):
        raise invalid(owner, field, value, "a nonstop Environment subclass or a function "
                      f"returning one; it names a {type(obj).__name__}")
    try:
        inspect.signature(obj).bind(**args)
    except TypeError as error:
        raise invalid(owner, "args", dict(args), f"keyword arguments {value} accepts "
                      f"({_one_line(error)}; its signature: {inspect.signature(obj)})") from None
    except ValueError:
        pass


def build_environment(obj: Any, args: Mapping[str, Any], *, owner: str, field: str,
                      value: str) -> Environment:
    """`obj(**args)`, which must be an Environment."""
    env = obj(**args)
    if not isinstance(env, Environment):
        raise invalid(owner, field, value, "a nonstop Environment subclass or a function "
                      f"returning one; it returned a {type(env).__name__}")
    return env


@dataclasses.dataclass(frozen=True, kw_only=True)
class FunctionTools:
    """The pieces a `FunctionToolEnv` is made of, resolved once from their import paths."""

    tools: tuple[Tool, ...]
    reward: Reward
    system_prompt: str | None = None
    max_turns: int = 8


class FunctionToolEnv(ToolEnvironment):
    """A ToolEnvironment over a user's functions: the model calls `tools`; its first turn
    without a tool call is the answer, scored by `reward(prompt, answer, example)` off the
    event loop. Tasks come from `task_for_seed`."""

    def __init__(self, parts: FunctionTools, task_for_seed: Callable[[int], Example]) -> None:
        self.system_prompt = parts.system_prompt
        self._task_for_seed = task_for_seed
        self._reward = reward_on_thread(parts.reward)
        super().__init__(tools=ToolSet(parts.tools), reward_fn=self._score_answer,
                         max_turns=parts.max_turns)

    def sample_task(self, seed: int) -> Task:
        example = self._task_for_seed(seed)
        return Task(prompt=example.prompt, answer=example.answer,
                    info={"example": example, **example.metadata})

    async def _score_answer(self, task: Task, answer: str) -> float:
        example = task.info.get("example") or Example(prompt=task.prompt, answer=task.answer)
        return await self._reward(task.prompt, answer, example)

    def close(self) -> None:
        self.tools.close()


__all__ = ["FunctionToolEnv", "FunctionTools", "SchemaError", "build_environment",
           "check_environment", "function_schema", "import_object", "load_reward", "load_tool",
           "reward_on_thread", "tool_from_function"]
