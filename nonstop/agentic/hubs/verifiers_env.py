"""Environments written for `verifiers` (PyPI `verifiers`, its `verifiers.v1` API), run by nonstop.

    env:
      path: nonstop.agentic.hubs.verifiers_env:VerifiersEnv
      args: {taskset: "my_pkg.envs:MathTaskset", max_turns: 4}

A verifiers environment is a `Taskset` (its `Task`s: prompt, system prompt, `@vf.reward` /
`@vf.metric` / `@vf.stop` methods, per-task `toolsets`) played by a `Harness` that drives the
model through an OpenAI-compatible endpoint. Here nonstop's Agent is the harness: it samples
token in / token out in its engine session, and this adapter maps the rest onto `Environment`:

- prompt: `TaskData.prompt` (text or messages) after `TaskData.system_prompt` (or the taskset's);
- tools: every `@vf.tool` of the taskset's and the task's `Toolset`s, registered on an in-process
  MCP server (the library's own `Toolset.register`, so schemas are the ones MCP derives), named
  `<server>_<tool>` as verifiers' MCP harness names them, called through `MCPServer.call_tool`;
- the episode ends at the first turn without a tool call, or when a `Trace`-typed `@vf.stop`
  returns true, or after `max_turns`;
- reward: the conversation becomes a `vf.Trace` (one branch, the model's turns `sampled`) and
  `Task.score(trace)` runs the task's rewards and metrics; the reward is `trace.reward`, their
  weighted sum. Metrics land in `info["metrics"]` of the last step.

Not covered: harness programs and runtimes (containers, sandboxes, `Task.setup`/`finalize`,
scoring signals that need a runtime are skipped as verifiers skips them offline), Request- or
Response-typed `@vf.stop`s and `@vf.intercept`s (they act on OpenAI wire objects nonstop never
builds), a typed `State` shared between tool calls (each call gets a fresh one, as verifiers'
servers do without a state channel), user simulators, multi-agent `Env`s, and plugged judges
that call a model. Sync `@vf.tool` methods run on the event loop (MCP calls them there).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from collections.abc import Callable
from typing import Any

import verifiers.v1 as vf
from mcp.server.mcpserver import MCPServer
from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content
from verifiers.v1.session import call_hook, hook_boundary

from nonstop.agentic.environment import (
    AgentAction,
    Environment,
    Observation,
    StepResult,
    Task,
)
from nonstop.agentic.hubs.common import held_out_split, import_if_path, partition
from nonstop.agentic.tools import Tool, ToolSet
from nonstop.models.chat import Message, ToolCall

MAX_TASKS = 10_000  # read from an infinite taskset at most


@dataclasses.dataclass(frozen=True)
class MessagesObservation(Observation):
    """An observation that opens with whole messages (a verifiers prompt given as messages)."""

    opening: tuple[Message, ...] = ()

    def messages(self) -> list[Message]:
        return list(self.opening) or super().messages()


def _text(content: Any) -> str:
    return vf.types.content_text(content) if not isinstance(content, str) else content


def to_nonstop(message: Any) -> Message:
    """A verifiers message as a nonstop Message (text content)."""
    if isinstance(message, vf.SystemMessage):
        return Message.system(_text(message.content))
    if isinstance(message, vf.UserMessage):
        return Message.user(_text(message.content))
    if isinstance(message, vf.ToolMessage):
        return Message.tool(_text(message.content), tool_call_id=message.tool_call_id,
                            name=message.name)
    calls = [ToolCall(name=c.name, arguments=c.arguments, id=c.id)
             for c in message.tool_calls or ()]
    return Message.assistant(message.content or "", tool_calls=calls)


def to_verifiers(message: Message) -> Any:
    """A nonstop Message as a verifiers message."""
    if message.role == "system":
        return vf.SystemMessage(content=message.content)
    if message.role == "user":
        return vf.UserMessage(content=message.content)
    if message.role == "tool":
        return vf.ToolMessage(content=message.content, tool_call_id=message.tool_call_id or "",
                              name=message.name)
    calls = [vf.ToolCall(id=c.id or f"call_{i}", name=c.name,
                         arguments=c.arguments if isinstance(c.arguments, str)
                         else json.dumps(dict(c.arguments)))
             for i, c in enumerate(message.tool_calls)]
    return vf.AssistantMessage(content=message.content or None, tool_calls=calls or None)


class _Servers:
    """Toolsets registered on in-process MCP servers, exposed as nonstop Tools."""

    def __init__(self) -> None:
        self.tools: list[Tool] = []
        self.schemas: list[vf.Tool] = []

    async def add(self, toolset: Any, *, timeout_s: float) -> None:
        server = MCPServer(toolset.server_name or type(toolset).__name__)
        toolset.register(server)
        prefix = toolset.server_name
        for info in await server.list_tools():
            name = f"{prefix}_{info.name}" if prefix else info.name
            self.tools.append(Tool(_caller(server, info.name), name=name,
                                   description=info.description or "",
                                   parameters=info.input_schema, timeout_s=timeout_s))
            self.schemas.append(vf.Tool(name=name, description=info.description or "",
                                        parameters=info.input_schema))


def _caller(server: MCPServer, name: str) -> Callable[..., Any]:
    async def call(**arguments: Any) -> str:
        result = await server.call_tool(name, arguments)
        text = mcp_content_to_chat_content(result.content)
        text = text if isinstance(text, str) else str(text)
        if result.is_error:
            raise RuntimeError(text)
        return text

    return call


class VerifiersEnv(Environment):
    """One episode of a verifiers taskset's task (see the module docstring).

    `taskset`: a `vf.Taskset` instance, a Taskset class (built with `taskset_config`, a mapping
    for its config type), a function returning one, or an import path to any of these.
    `eval_fraction`: held-out tasks are those whose `task.key` hashes below it, drawn for seeds
    from `HELD_OUT_SEED` on (None: every seed draws from all tasks).
    """

    def __init__(self, taskset: Any, *, taskset_config: dict[str, Any] | None = None,
                 max_turns: int = 8, eval_fraction: float | None = None,
                 tool_timeout_s: float = 30.0) -> None:
        if max_turns < 1:
            raise ValueError(f"VerifiersEnv.max_turns={max_turns!r} is invalid; expected >= 1")
        self.taskset, self._split = _loaded(taskset, json.dumps(taskset_config or {},
                                                                sort_keys=True), eval_fraction)
        self.max_turns = max_turns
        self.tool_timeout_s = tool_timeout_s
        self.tools = ToolSet()
        self.task: vf.Task | None = None
        self.messages: list[Message] = []
        self.trace: vf.Trace | None = None
        self.turns = 0
        self.done = False
        self.reward: float | None = None

    # -- tasks

    def sample_task(self, seed: int) -> Task:
        task = held_out_split(self._split, seed)
        return Task(prompt=task.data.prompt_text, answer="", info={"vf_task": task})

    # -- episode

    async def reset(self, task: Task | None = None, *, seed: int = 0) -> Observation:
        task = task if task is not None else self.sample_task(seed)
        self.task = task.info["vf_task"]
        data = self.task.data
        servers = _Servers()
        for toolset in [*_shared_toolsets(self.taskset),
                        *type(self.task).toolsets(self.task.config)]:
            await toolset.setup()
            await toolset.setup_task(self.task)
            await servers.add(toolset, timeout_s=self.tool_timeout_s)
        self.tools.close()
        self.tools = ToolSet(servers.tools)
        self.trace = vf.Trace(
            task=vf.TraceTask(type=type(self.task).__name__, data=data, key=self.task.key,
                              hash=self.task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig()), tools=servers.schemas)
        system = data.system_prompt or self.taskset.system_prompt
        opening = [Message.system(system)] if system else []
        if isinstance(data.prompt, str) or data.prompt is None:
            opening.append(Message.user(data.prompt or ""))
        else:
            opening += [to_nonstop(m) for m in data.prompt]
        self.messages, self.turns, self.done, self.reward = [], 0, False, None
        for message in opening:
            self._record(message, sampled=False)
        return MessagesObservation(text=data.prompt_text, system=system, task=task,
                                   opening=tuple(opening))

    def _record(self, message: Message, *, sampled: bool) -> None:
        assert self.trace is not None
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(vf.MessageNode(parent=parent, message=to_verifiers(message),
                                               sampled=sampled))
        self.messages.append(message)

    async def step(self, action: AgentAction) -> StepResult:
        if self.task is None or self.done:
            raise RuntimeError("step() before reset() or after the episode ended")
        self.turns += 1
        calls = tuple(c if c.id else dataclasses.replace(c, id=f"call_{self.turns}_{i}")
                      for i, c in enumerate(action.tool_calls))
        self._record(Message.assistant(action.content, tool_calls=calls), sampled=True)
        results = await self.tools.call_all(calls, action.parse_errors) if (
            calls or action.parse_errors) else []
        messages = tuple(r.message() for r in results)
        for message in messages:
            self._record(message, sampled=False)
        stopped = await self._stop_hook()
        if stopped or not results or self.turns >= self.max_turns:
            self.done = True
            self.reward = await self._score(stopped or ("done" if not results else "max_turns"))
        info = {"turns": self.turns, "tool_errors": [r.error_kind for r in results if not r.ok]}
        if self.done:
            info["metrics"] = dict(self.trace.metrics) if self.trace else {}
        return StepResult(messages=messages, reward=self.reward, done=self.done, info=info)

    async def _stop_hook(self) -> str | None:
        assert self.task is not None and self.trace is not None
        for hook in self.task.hooks("stop"):
            if hook_boundary(hook, allow_trace=True) is not vf.Trace:
                continue
            if await call_hook(hook, {vf.Trace: self.trace}):
                return hook.__name__
        return None

    async def _score(self, condition: str) -> float:
        assert self.task is not None and self.trace is not None
        self.trace.stop(condition)
        self.trace.is_completed = self.trace.ok = True
        await self.task.score(self.trace)
        return float(self.trace.reward)

    async def final_reward(self) -> float:
        if self.reward is None and self.task is not None and self.trace is not None:
            self.reward = await self._score("cut_off")  # the agent ended it (a limit)
        return self.reward if self.reward is not None else 0.0

    def close(self) -> None:
        self.tools.close()


def _taskset(obj: Any, config: dict[str, Any] | None) -> Any:
    if isinstance(obj, vf.Taskset):
        if config:
            raise ValueError("VerifiersEnv: taskset_config is for a Taskset class, not an "
                             "instance")
        return obj
    if isinstance(obj, type) and issubclass(obj, vf.Taskset):
        config_type = _config_type(obj)
        return obj(config_type(**config))
    if callable(obj):
        made = obj(**config)
        if isinstance(made, vf.Taskset):
            return made
        raise TypeError(f"VerifiersEnv: {obj!r} returned a {type(made).__name__}, not a "
                        "verifiers Taskset")
    raise TypeError(f"VerifiersEnv: taskset must be a verifiers Taskset, a Taskset class or a "
                    f"function returning one; got a {type(obj).__name__}")


def _config_type(cls: type) -> type:
    from verifiers.v1.utils.generic import concrete_type

    return concrete_type(cls, vf.TasksetConfig) or vf.TasksetConfig


@functools.lru_cache(maxsize=16)
def _loaded(source: Any, config_json: str, eval_fraction: float | None
            ) -> tuple[Any, tuple[tuple[Any, ...], tuple[Any, ...]]]:
    """The taskset `source` names, built once, and its (training, held-out) tasks."""
    taskset = _taskset(import_if_path(source, "taskset"), json.loads(config_json))
    tasks = list(itertools.islice(iter(taskset), MAX_TASKS))
    if not tasks:
        raise ValueError(f"VerifiersEnv: {type(taskset).__name__} yields no tasks")
    return taskset, partition(tasks, eval_fraction, key=lambda t: t.key)


def _shared_toolsets(taskset: Any) -> list[Any]:
    return list(type(taskset).toolsets(taskset.config))


__all__ = ["MessagesObservation", "VerifiersEnv", "to_nonstop", "to_verifiers"]
