"""Environments written for OpenEnv (PyPI `openenv-core`), run in-process by nonstop.

    env:
      path: nonstop.agentic.hubs.openenv_env:OpenEnvEnv
      args: {env: "my_pkg.envs:WordleEnvironment", system_prompt: "Guess the word."}

An OpenEnv environment is a Gym-style server object: `reset(seed) -> Observation`,
`step(Action) -> Observation` (with `done` and `reward`), usually scoring through its `rubric`.
This adapter makes one per episode (from a class or a factory; OpenEnv instances hold one
episode's state) and maps the model's turns onto actions:

- an `MCPEnvironment` (tools on a FastMCP server): its tools, listed with `ListToolsAction`, are
  nonstop Tools that step the environment with `CallToolAction`; a tool's error is the error the
  model sees; a turn without a tool call ends the episode;
- any other environment: when its Action has a single required string field (besides
  `metadata`), the model's text is that field (a chat game: `EchoAction(message=...)`); otherwise
  the Action is one tool, `step` by default, whose parameters are the Action's JSON schema. The
  rendered observation comes back as a user turn (text actions) or as the tool's result, and the
  episode ends when an observation says `done` (a tool-action turn without a call ends it too).

The episode reward is the sum of the observations' rewards (`reward="last"`: the last one), which
is where an OpenEnv environment puts its rubric's score. The opening prompt is the reset
observation rendered as text (its one string field, else its JSON), or `prompt`, after
`system_prompt`.
Synchronous `reset`/`step` run on one worker thread per episode (so the event loop never waits on
them, and an environment that `REQUIRES_SINGLE_THREAD_EXECUTOR` keeps its thread).

Not covered: the HTTP/WebSocket client side (`EnvClient`, containers, Hugging Face Spaces: run the
environment's Python class here instead), code mode (`execute_code`), tool modes other than the
environment's current one, image or non-text observations, and reading `rubric` directly (only
what `step` writes into `observation.reward` counts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import typing
from typing import Any, Literal

from openenv.core.env_server.interfaces import Environment as OpenEnvironment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import (
    CallToolAction,
    CallToolObservation,
    ListToolsAction,
)
from openenv.core.env_server.types import Action as OpenAction
from openenv.core.env_server.types import Observation as OpenObservation

from nonstop.agentic.environment import (
    AgentAction,
    Environment,
    Observation,
    StepResult,
    Task,
)
from nonstop.agentic.hubs.common import HELD_OUT_SEED, import_if_path
from nonstop.agentic.tools import Tool, ToolSet
from nonstop.models.chat import Message

_OBSERVATION_BASE = frozenset(OpenObservation.model_fields)  # done, reward, metadata
_ACTION_BASE = frozenset(OpenAction.model_fields)  # metadata


def render(observation: Any) -> str:
    """An observation as the text the model reads: its one string field, else its fields as
    JSON (its metadata when it has no fields of its own)."""
    if isinstance(observation, CallToolObservation):
        return _tool_text(observation)
    dumped = observation.model_dump(mode="json")
    fields = {k: v for k, v in dumped.items() if k not in _OBSERVATION_BASE}
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    return json.dumps(fields or dumped.get("metadata") or {}, default=str)


def _tool_text(observation: CallToolObservation) -> str:
    result = observation.result
    content = getattr(result, "content", None)
    if content is not None:
        return "\n".join(getattr(block, "text", str(block)) for block in content)
    data = getattr(result, "data", result)
    return data if isinstance(data, str) else json.dumps(data, default=str)


def action_type(env_cls: type) -> type:
    """The Action class an OpenEnv Environment subclass is parameterized with."""
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], OpenAction):
                return args[0]
    raise TypeError(f"OpenEnvEnv: cannot tell the Action type of {env_cls.__name__}; "
                    "pass action='my_pkg.models:MyAction'")


def text_field(action_cls: type) -> str | None:
    """The Action's single required string field, if that is all it needs."""
    required = [name for name, field in action_cls.model_fields.items()
                if name not in _ACTION_BASE and field.is_required()]
    if len(required) == 1 and action_cls.model_fields[required[0]].annotation is str:
        return required[0]
    return None


class OpenEnvEnv(Environment):
    """One episode of an OpenEnv environment (see the module docstring).

    `env`: an OpenEnv Environment class, a function returning an instance, or an import path to
    either; `env_args` its keyword arguments. `prompt`: the opening user text, for environments
    whose reset observation is not one (default: the rendered observation). `action`: the Action class (default: the one the
    class is parameterized with); `action_tool`: the tool's name when actions are tool calls.
    Seeds are passed to `reset`; held-out episodes (seeds from `HELD_OUT_SEED`) get seeds of
    their own, which the environment's generator keeps apart only if it draws from the seed.
    """

    def __init__(self, env: Any, *, env_args: dict[str, Any] | None = None,
                 system_prompt: str | None = None, prompt: str | None = None, action: Any = None,
                 action_tool: str = "step", reward: Literal["sum", "last"] = "sum",
                 max_turns: int = 8, tool_timeout_s: float = 30.0) -> None:
        if reward not in ("sum", "last"):
            raise ValueError(f"OpenEnvEnv.reward={reward!r} is invalid; expected 'sum' or 'last'")
        if max_turns < 1:
            raise ValueError(f"OpenEnvEnv.max_turns={max_turns!r} is invalid; expected >= 1")
        factory = import_if_path(env, "env")
        self.env = factory(**(env_args or {}))
        if not isinstance(self.env, OpenEnvironment):
            raise TypeError(f"OpenEnvEnv: {factory!r} made a {type(self.env).__name__}, not an "
                            "OpenEnv Environment")
        self.system_prompt = system_prompt
        self.prompt = prompt
        self.reward_mode = reward
        self.max_turns = max_turns
        self.tool_timeout_s = tool_timeout_s
        self.mcp = isinstance(self.env, MCPEnvironment)
        self.action_cls = None if self.mcp else (import_if_path(action, "action")
                                                 or action_type(type(self.env)))
        self.text_field = None if self.mcp else text_field(self.action_cls)
        self.action_tool = action_tool
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "nonstop-openenv")
        self.tools = ToolSet()
        self.rewards: list[float] = []
        self.turns = 0
        self.done = False

    def sample_task(self, seed: int) -> Task:
        split = "eval" if seed >= HELD_OUT_SEED else "train"
        return Task(prompt="", answer="", info={"seed": seed, "split": split})

    async def _run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`env.<method>_async` when the environment overrides it, else the sync method on the
        episode's thread."""
        own = getattr(type(self.env), f"{method}_async")
        if own is not getattr(OpenEnvironment, f"{method}_async"):
            return await getattr(self.env, f"{method}_async")(*args, **kwargs)
        call = functools.partial(getattr(self.env, method), *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    async def reset(self, task: Task | None = None, *, seed: int = 0) -> Observation:
        task = task if task is not None else self.sample_task(seed)
        seed = int(task.info.get("seed", seed))
        observation = await self._run("reset", seed=seed)
        self.rewards, self.turns, self.done = [], 0, False
        self._observe(observation)
        self.tools.close()
        self.tools = ToolSet(await self._tools())
        text = self.prompt if self.prompt is not None else render(observation)
        return Observation(text=text, system=self.system_prompt, task=task)

    async def _tools(self) -> list[Tool]:
        if self.mcp:
            listed = await self.env.step_async(ListToolsAction())
            if listed.metadata.get("error"):
                raise RuntimeError(f"OpenEnvEnv: listing the tools failed: "
                                   f"{listed.metadata['error']}")
            return [Tool(self._mcp_caller(t.name), name=t.name, description=t.description,
                         parameters=t.input_schema or {"type": "object"},
                         timeout_s=self.tool_timeout_s) for t in listed.tools]
        if self.text_field is not None:
            return []
        schema = self.action_cls.model_json_schema()
        for key in _ACTION_BASE:
            schema.get("properties", {}).pop(key, None)
        description = (self.action_cls.__doc__ or "").strip().split("\n\n")[0] or \
            f"Take one {self.action_cls.__name__} in the environment."
        return [Tool(self._action_caller(), name=self.action_tool,
                     description=" ".join(description.split()), parameters=schema,
                     timeout_s=self.tool_timeout_s)]

    def _observe(self, observation: Any) -> None:
        if observation.reward is not None:
            self.rewards.append(float(observation.reward))
        self.done = self.done or bool(observation.done)

    def _mcp_caller(self, name: str):
        async def call(**arguments: Any) -> str:
            observation = await self.env.step_async(
                CallToolAction(tool_name=name, arguments=arguments),
                timeout_s=self.tool_timeout_s)
            self._observe(observation)
            if observation.error is not None:
                raise RuntimeError(f"{observation.error.error_type.value}: "
                                   f"{observation.error.message}")
            if getattr(observation.result, "is_error", False):
                raise RuntimeError(_tool_text(observation))
            return render(observation)

        return call

    def _action_caller(self):
        async def call(**arguments: Any) -> str:
            observation = await self._run("step", self.action_cls.model_validate(arguments))
            self._observe(observation)
            return render(observation)

        return call

    async def step(self, action: AgentAction) -> StepResult:
        if self.done:
            raise RuntimeError("step() after the episode ended")
        self.turns += 1
        messages: tuple[Message, ...] = ()
        errors: list[str | None] = []
        if self.text_field is not None:
            observation = await self._run("step", self.action_cls(
                **{self.text_field: action.content}))
            self._observe(observation)
            if not self.done:
                messages = (Message.user(render(observation)),)
        elif action.tool_calls or action.parse_errors:
            results = await self.tools.call_all(action.tool_calls, action.parse_errors)
            messages = tuple(r.message() for r in results)
            errors = [r.error_kind for r in results if not r.ok]
        else:
            self.done = True  # an answer without a tool call ends a tool-driven episode
        if self.turns >= self.max_turns:
            self.done = True
        reward = await self.final_reward() if self.done else None
        return StepResult(messages=messages, reward=reward, done=self.done,
                          info={"turns": self.turns, "tool_errors": errors,
                                "rewards": list(self.rewards)})

    async def final_reward(self) -> float:
        if not self.rewards:
            return 0.0
        return self.rewards[-1] if self.reward_mode == "last" else float(sum(self.rewards))

    def close(self) -> None:
        self.tools.close()
        try:
            self.env.close()
        finally:
            self._thread.shutdown(wait=False, cancel_futures=True)


__all__ = ["OpenEnvEnv", "action_type", "render", "text_field"]
