"""Tools the model calls, and a ToolSet that dispatches parsed calls to them without ever raising.

    add = Tool(lambda a, b: a + b, name="add", description="Add two numbers.",
               parameters={"type": "object", "properties": {"a": {"type": "number"},
                           "b": {"type": "number"}}, "required": ["a", "b"]})
    tools = ToolSet([add])
    result = await tools.call(ToolCall(name="add", arguments={"a": 1, "b": 2}))   # output "3"
    template.render(messages, tools=tools.schemas())

A `Tool` wraps a sync or async function (sync ones run in a thread pool, so the event loop keeps
going), validates arguments against its JSON schema, enforces a timeout and truncates its output.
`ToolSet.call` turns every failure — unknown tool, arguments that are not JSON, arguments that do
not match the schema, a timeout, an exception — into a `ToolResult` whose `output` is the error
text the model sees and whose `error_kind` is counted (in `error_counts` and through
`nonstop.perf`). A sync tool that hangs keeps its worker thread after the timeout (threads cannot
be killed); each ToolSet has its own pool, so hung tools cannot starve other ToolSets.

Arguments are validated by a small JSON-schema subset (type, properties, required,
additionalProperties, items, enum, minimum, maximum, minLength, maxLength): the `jsonschema`
package is not a dependency.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import inspect
import json
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

from nonstop import perf
from nonstop.agentic.parsers import ParseError
from nonstop.models.chat import Message, ToolCall

ToolErrorKind = Literal[
    "unknown_tool", "invalid_json", "missing_name", "bad_arguments", "timeout", "exception"
]
# perf counters: every dispatched call, and every failed one (tagged kind=..., tool=...).
TOOL_CALLS = "rollout/tool_calls"
TOOL_ERRORS = "rollout/tool_errors"

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, Mapping),
    "array": lambda v: isinstance(v, (list, tuple)),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, float) and v.is_integer())
    ),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def schema_errors(value: Any, schema: Mapping[str, Any], path: str = "arguments") -> list[str]:
    """Where `value` breaks `schema` (the subset named in the module docstring); [] if nowhere."""
    expected = schema.get("type")
    if expected is not None:
        types = [expected] if isinstance(expected, str) else list(expected)
        if not any(_JSON_TYPES[t](value) for t in types if t in _JSON_TYPES):
            return [f"{path} must be of type {' or '.join(types)}, got {type(value).__name__}"]
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path} must be one of {list(schema['enum'])}, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path} must be >= {schema['minimum']}, got {value}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path} must be <= {schema['maximum']}, got {value}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path} must have at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path} must have at most {schema['maxLength']} characters")
    if isinstance(value, Mapping):
        properties = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{path} is missing the required property {key!r}")
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(item, properties[key], f"{path}.{key}")
            elif schema.get("additionalProperties", True) is False:
                errors.append(f"{path} has an unexpected property {key!r}")
    if isinstance(value, (list, tuple)) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    return errors


class ToolError(Exception):
    """A tool call that failed in a way the model should be told about."""

    def __init__(self, kind: ToolErrorKind, message: str):
        super().__init__(message)
        self.kind = kind


def truncate(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars`, with a marker saying how much was dropped."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[truncated {len(text) - max_chars} chars]"


class Tool:
    """A named function with a JSON-schema signature, a timeout and an output limit."""

    def __init__(
        self,
        fn: Callable[..., Any] | Callable[..., Awaitable[Any]],
        *,
        name: str,
        description: str,
        parameters: Mapping[str, Any],
        timeout_s: float = 10.0,
        max_output_chars: int = 4096,
    ):
        if not name or not name.replace("_", "").isalnum():
            raise ValueError(f"Tool name must be a non-empty identifier, got {name!r}")
        if parameters.get("type") != "object":
            raise ValueError(
                f"Tool {name!r}: parameters must be a JSON schema of type 'object', "
                f"got type {parameters.get('type')!r}"
            )
        if not timeout_s > 0 or max_output_chars < 1:
            raise ValueError(
                f"Tool {name!r}: timeout_s must be > 0 and max_output_chars >= 1, got "
                f"{timeout_s} and {max_output_chars}"
            )
        self.fn = fn
        self.name = name
        self.description = description
        self.parameters = dict(parameters)
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self._is_async = inspect.iscoroutinefunction(fn)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function form a chat template takes in `tools=`."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    async def __call__(
        self,
        arguments: Mapping[str, Any],
        *,
        executor: concurrent.futures.Executor | None = None,
    ) -> str:
        """Validate, run under the timeout, and return the (truncated) output as text.

        Raises ToolError with kind "bad_arguments", "timeout" or "exception".
        """
        if errors := schema_errors(arguments, self.parameters):
            raise ToolError("bad_arguments", f"bad arguments for {self.name}: {'; '.join(errors)}")
        kwargs = dict(arguments)
        if self._is_async:
            work = self.fn(**kwargs)
        else:
            loop = asyncio.get_running_loop()
            work = loop.run_in_executor(executor, functools.partial(self.fn, **kwargs))
        try:
            value = await asyncio.wait_for(work, self.timeout_s)
        except TimeoutError:
            raise ToolError(
                "timeout", f"tool {self.name} timed out after {self.timeout_s:g}s"
            ) from None
        except ToolError:
            raise
        except (Exception, SystemExit) as error:
            raise ToolError(
                "exception", f"tool {self.name} raised {type(error).__name__}: {error}"
            ) from error
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        return truncate(text, self.max_output_chars)

    def __repr__(self) -> str:
        return f"Tool({self.name!r}, timeout_s={self.timeout_s:g})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolResult:
    """The outcome of one call: `output` is what the model sees (the error text on failure)."""

    call: ToolCall | None  # None for a call that could not be parsed
    output: str
    error_kind: ToolErrorKind | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def message(self) -> Message:
        """The tool turn to append to the conversation."""
        if self.call is None:
            return Message.tool(self.output)
        return Message.tool(self.output, tool_call_id=self.call.id, name=self.call.name)


class ToolSet:
    """Tools by name; dispatches calls and counts what went wrong, per kind."""

    def __init__(self, tools: Sequence[Tool] = (), *, max_threads: int = 8):
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self._tools:
                raise ValueError(f"ToolSet: two tools are named {tool.name!r}")
            self._tools[tool.name] = tool
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_threads, thread_name_prefix="nonstop-tool"
        )
        self.calls: collections.Counter[str] = collections.Counter()  # by tool name
        self.error_counts: collections.Counter[str] = collections.Counter()  # by error kind

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self._tools.values()]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def _failed(self, call: ToolCall | None, kind: ToolErrorKind, message: str, start: float):
        self.error_counts[kind] += 1
        perf.count(TOOL_ERRORS, kind=kind, tool=call.name if call else None)
        return ToolResult(
            call=call,
            output=f"Error: {message}",
            error_kind=kind,
            duration_s=time.perf_counter() - start,
        )

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call; every failure comes back as an error ToolResult."""
        start = time.perf_counter()
        self.calls[call.name] += 1
        perf.count(TOOL_CALLS, tool=call.name)
        tool = self._tools.get(call.name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            return self._failed(
                call, "unknown_tool", f"unknown tool {call.name!r} (available: {known})", start
            )
        arguments = call.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as error:
                return self._failed(
                    call, "invalid_json", f"arguments of {call.name} are not JSON ({error})", start
                )
            if not isinstance(arguments, Mapping):
                return self._failed(
                    call, "bad_arguments", f"arguments of {call.name} must be an object", start
                )
        try:
            with perf.span(perf.ROLLOUT_TOOL_WAIT, tool=call.name):
                output = await tool(arguments, executor=self._executor)
        except ToolError as error:
            return self._failed(call, error.kind, str(error), start)
        return ToolResult(call=call, output=output, duration_s=time.perf_counter() - start)

    def parse_error_result(self, error: ParseError) -> ToolResult:
        """The observation for a call the parser could not read (counted like a failed call)."""
        self.error_counts[error.kind] += 1
        perf.count(TOOL_ERRORS, kind=error.kind, tool=None)
        return ToolResult(call=None, output=error.observation(), error_kind=error.kind)

    async def call_all(
        self, calls: Sequence[ToolCall], errors: Sequence[ParseError] = ()
    ) -> list[ToolResult]:
        """All calls concurrently (results in call order), then one result per parse error."""
        results = list(await asyncio.gather(*(self.call(c) for c in calls)))
        return results + [self.parse_error_result(e) for e in errors]

    def close(self) -> None:
        """Release the worker threads (a hung sync tool's thread is abandoned, not joined)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
