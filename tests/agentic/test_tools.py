"""Tool dispatch: every failure (unknown tool, bad JSON, wrong types, hang, raise, megabytes of
output) becomes an observation for the model, is counted per kind and in perf, and never raises."""

import asyncio
import threading
import time

import pytest

from nonstop import perf
from nonstop.agentic.parsers import parse_tool_calls
from nonstop.agentic.tools import TOOL_CALLS, TOOL_ERRORS, Tool, ToolSet, schema_errors
from nonstop.models.chat import ChatTemplate, Message, ToolCall

ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "number", "minimum": 0}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


@pytest.fixture
def recorder():
    previous = perf.recorder.STATE.base_config
    rec = perf.configure(perf.PerfConfig())
    yield rec
    perf.configure(previous)


def make_tools(release: threading.Event) -> ToolSet:
    def add(a: int, b: float) -> float:
        return a + b

    async def slow(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "done"

    def hang() -> str:  # a sync tool stuck in its thread until the test releases it
        release.wait(10)
        return "late"

    def boom() -> str:
        raise RuntimeError("kaput")

    def flood() -> str:
        return "x" * 3_000_000

    none = {"type": "object", "properties": {}}
    return ToolSet([
        Tool(add, name="add", description="Add.", parameters=ADD_SCHEMA),
        Tool(slow, name="slow", description="Sleep.", timeout_s=0.2, parameters={
            "type": "object", "properties": {"seconds": {"type": "number"}}}),
        Tool(hang, name="hang", description="Hang.", parameters=none, timeout_s=0.2),
        Tool(boom, name="boom", description="Raise.", parameters=none),
        Tool(flood, name="flood", description="Print.", parameters=none, max_output_chars=1000),
    ])  # fmt: skip


def test_schema_errors_subset():
    assert schema_errors({"a": 1, "b": 2.5}, ADD_SCHEMA) == []
    assert schema_errors({"a": 2.0, "b": 0}, ADD_SCHEMA) == []  # 2.0 is an integer in JSON
    assert schema_errors({"a": True, "b": 1}, ADD_SCHEMA) == [
        "arguments.a must be of type integer, got bool"
    ]
    assert schema_errors({"a": 1}, ADD_SCHEMA) == ["arguments is missing the required property 'b'"]
    assert schema_errors({"a": 1, "b": -1, "c": 0}, ADD_SCHEMA) == [
        "arguments.b must be >= 0, got -1",
        "arguments has an unexpected property 'c'",
    ]
    enum = {"type": "array", "items": {"type": "string", "enum": ["up", "down"]}}
    assert schema_errors(["up", "left"], enum) == [
        "arguments[1] must be one of ['up', 'down'], got 'left'"
    ]


def test_every_failure_becomes_a_counted_observation(recorder):
    release = threading.Event()
    tools = make_tools(release)
    calls = [
        ToolCall(name="add", arguments={"a": 2, "b": 0.5}, id="c0"),
        ToolCall(name="nope", arguments={}, id="c1"),
        ToolCall(name="add", arguments='{"a": 1, "b": ', id="c2"),
        ToolCall(name="add", arguments={"a": "two", "b": 1}, id="c3"),
        ToolCall(name="slow", arguments={"seconds": 5}, id="c4"),
        ToolCall(name="hang", arguments={}, id="c5"),
        ToolCall(name="boom", arguments={}, id="c6"),
        ToolCall(name="flood", arguments={}, id="c7"),
        ToolCall(name="add", arguments='{"a": 1, "b": 2}', id="c8"),
    ]

    async def main():
        start = time.perf_counter()
        results = await tools.call_all(calls)
        return results, time.perf_counter() - start

    try:
        results, elapsed = asyncio.run(main())
    finally:
        release.set()
    kinds = [r.error_kind for r in results]
    assert kinds == [None, "unknown_tool", "invalid_json", "bad_arguments", "timeout", "timeout",
                     "exception", None, None]  # fmt: skip
    assert elapsed < 2.0  # concurrent calls; the two timeouts (0.2 s) do not add up to seconds
    out = [r.output for r in results]
    assert out[0] == "2.5" and out[8] == "3"
    assert "unknown tool 'nope'" in out[1] and "add" in out[1]
    assert "arguments.a must be of type integer" in out[3]
    assert out[4] == "Error: tool slow timed out after 0.2s"
    assert out[5] == "Error: tool hang timed out after 0.2s"
    assert out[6] == "Error: tool boom raised RuntimeError: kaput"
    assert out[7] == "x" * 1000 + "\n[truncated 2999000 chars]"
    assert all(o.startswith("Error: ") for o, k in zip(out, kinds, strict=True) if k)
    assert dict(tools.error_counts) == {
        "unknown_tool": 1,
        "invalid_json": 1,
        "bad_arguments": 1,
        "timeout": 2,
        "exception": 1,
    }
    assert tools.calls["add"] == 4
    message = results[1].message()
    assert (message.role, message.tool_call_id, message.name) == ("tool", "c1", "nope")
    events = recorder.events()
    errors = [e for e in events if e.name == TOOL_ERRORS]
    assert sorted(e.tags["kind"] for e in errors) == sorted(k for k in kinds if k)
    assert sum(e.value for e in events if e.name == TOOL_CALLS) == len(calls)
    waits = [e for e in events if e.name == perf.ROLLOUT_TOOL_WAIT]
    assert {e.tags["tool"] for e in waits} == {"add", "slow", "hang", "boom", "flood"}
    tools.close()


def test_parse_errors_become_observations_too():
    tools = make_tools(threading.Event())
    turn = parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        "<tool_call>{oops}</tool_call>",
        "qwen",
    )
    results = asyncio.run(tools.call_all(turn.tool_calls, turn.errors))
    assert [r.error_kind for r in results] == [None, "invalid_json"]
    assert results[1].call is None and results[1].output.startswith("Error: ")
    assert results[1].message().role == "tool"
    assert tools.error_counts["invalid_json"] == 1
    tools.close()


def test_schemas_render_in_chat_template():
    tools = make_tools(threading.Event())
    text = ChatTemplate.builtin("qwen").render([Message.user("hi")], tools=tools.schemas())
    assert '"name": "add"' in text and '"minimum": 0' in text
    assert tools.names == ("add", "slow", "hang", "boom", "flood")
    tools.close()


def test_tool_config_errors():
    with pytest.raises(ValueError, match="type 'object'"):
        Tool(print, name="p", description="", parameters={"type": "string"})
    with pytest.raises(ValueError, match="identifier"):
        Tool(print, name="bad name", description="", parameters={"type": "object"})
    tool = Tool(print, name="p", description="", parameters={"type": "object"})
    with pytest.raises(ValueError, match="two tools are named 'p'"):
        ToolSet([tool, tool])
