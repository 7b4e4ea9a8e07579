"""Environments: what an episode talks to. reset to a task, then step with each assistant turn.

    env = CalculatorEnv(CalculatorConfig())           # one instance per episode
    obs = await env.reset(seed=7)                      # obs.messages(): system + user prompt
    step = await env.step(AgentAction.from_text(text, parser))
    # step.messages: tool turns to append; step.done; step.reward (set when done)

An `Environment` holds one episode's state, so the orchestrator makes one per episode (they are
cheap; heavy shared things — a Sandbox, a document index — are passed in). Each turn the agent's
text is parsed into an `AgentAction`; `step` answers with the observation messages (tool results as
`Message(role="tool")`), a reward when the episode ends, and `info` (tool calls, errors).
Rewards may be async: `final_reward()` is awaited once the episode is done.

`ToolEnvironment` is the common case: run the parsed calls through a ToolSet (errors become
observations), and when the model answers without a tool call, score that answer with a reward
function and end the episode.

Held out by construction: the built-in environments split their problem space, not their seeds.
A problem belongs to the eval split when a stable hash of it (`split_of`) falls below the
environment's `eval_fraction`; `sample_task(seed, split)` draws from a seeded stream until it
finds a problem of `split` (`draw_in_split`), so training never sees an evaluation problem
whatever seeds are asked for. An environment whose `sample_task` takes only a seed (a user's, a
hub adapter) keeps the older convention: held-out tasks come from seeds `HELD_OUT_SEED + i`
(`draw_task` picks the right call).
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import inspect
import random
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

from nonstop.agentic.parsers import ParseError, ToolCallParser
from nonstop.agentic.tools import ToolSet
from nonstop.models.chat import Message, ToolCall

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")
HELD_OUT_SEED = 1_000_000  # seed-only environments: held-out task i is sample_task(this + i)
MAX_SPLIT_DRAWS = 10_000


def split_of(key: str, eval_fraction: float) -> Split:
    """The split a problem belongs to: a stable hash of `key` (its prompt, or what identifies
    the problem), independent of any seed."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "big") / 2**64 < eval_fraction else "train"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """One problem: the prompt the model sees and the reference its answer is scored against."""

    prompt: str
    answer: str
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Observation:
    """What the model sees at the start of an episode."""

    text: str
    system: str | None = None
    task: Task | None = None

    def messages(self) -> list[Message]:
        prefix = [Message.system(self.system)] if self.system else []
        return prefix + [Message.user(self.text)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentAction:
    """One assistant turn: its raw text, its prose, and its parsed tool calls and parse errors."""

    text: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    parse_errors: tuple[ParseError, ...] = ()

    @classmethod
    def from_text(cls, text: str, parser: ToolCallParser) -> AgentAction:
        turn = parser.parse(text)
        return cls(
            text=text, content=turn.content, tool_calls=turn.tool_calls, parse_errors=turn.errors
        )

    @classmethod
    def answer(cls, content: str) -> AgentAction:
        """A turn with no tool call (for scripted agents and demonstrations)."""
        return cls(text=content, content=content)

    @classmethod
    def calls(cls, *tool_calls: ToolCall, content: str = "") -> AgentAction:
        return cls(text=content, content=content, tool_calls=tuple(tool_calls))

    def message(self) -> Message:
        """The assistant turn as a Message (for demonstrations and logs, never re-tokenized)."""
        return Message.assistant(self.content, tool_calls=self.tool_calls)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepResult:
    messages: tuple[Message, ...]
    reward: float | None
    done: bool
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


RewardFn = Callable[[Task, str], float] | Callable[[Task, str], Awaitable[float]]


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid; expected 'train' or 'eval'")


def draw_in_split(
    generate: Callable[[random.Random], Task],
    rng: random.Random,
    split: Split,
    eval_fraction: float,
    *,
    key: Callable[[Task], str] = lambda t: t.prompt,
    owner: str = "Environment",
) -> Task:
    """The first problem `generate(rng)` makes whose hash `key` falls in `split`."""
    check_split(split)
    for _ in range(MAX_SPLIT_DRAWS):
        task = generate(rng)
        if split_of(key(task), eval_fraction) == split:
            return task
    raise ValueError(
        f"{owner}: no {split} problem in {MAX_SPLIT_DRAWS} draws at "
        f"eval_fraction={eval_fraction}; widen the problem space or change "
        "eval_fraction"
    )


def draw_task(env: Environment, seed: int, split: Split) -> Task:
    """Task `seed` of `split`: `env.sample_task(seed, split=split)` when it takes a split,
    else (a seed-only environment) `env.sample_task(seed)` for training and
    `env.sample_task(HELD_OUT_SEED + seed)` for evaluation."""
    check_split(split)
    if "split" in inspect.signature(env.sample_task).parameters:
        return env.sample_task(seed, split=split)
    return env.sample_task(seed if split == "train" else HELD_OUT_SEED + seed)


class Environment(abc.ABC):
    """One episode of a task. Subclasses set `tools` and `system_prompt`."""

    tools: ToolSet
    system_prompt: str | None = None

    @abc.abstractmethod
    def sample_task(self, seed: int, split: Split = "train") -> Task:
        """A task of `split` drawn deterministically from `seed`. Subclasses may take only a
        seed (then held-out tasks come from seeds `HELD_OUT_SEED` on, see `draw_task`)."""

    @abc.abstractmethod
    async def reset(self, task: Task | None = None, *, seed: int = 0) -> Observation:
        """Start an episode on `task` (drawn from `seed` when None)."""

    @abc.abstractmethod
    async def step(self, action: AgentAction) -> StepResult:
        """Apply one assistant turn."""

    @abc.abstractmethod
    async def final_reward(self) -> float:
        """The episode's reward (0.0 for an unfinished episode)."""

    def demonstration(self, task: Task) -> list[Message]:
        """A correct conversation for `task` (for SFT warm-up); not every env has one."""
        raise NotImplementedError(f"{type(self).__name__} has no demonstrations")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the episode holds (e.g. its state in a Ray actor); called once when the
        episode ends, however it ended."""


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in `text` ("... so the answer is 47." → 47.0), commas ignored."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def numeric_reward(task: Task, answer: str) -> float:
    """1.0 if the last number in the answer equals the task's numeric answer, else 0.0."""
    value = last_number(answer)
    return float(value is not None and abs(value - float(task.answer)) < 1e-6)


class ToolEnvironment(Environment):
    """Tool calls run through `tools`; a turn without calls is the final answer, scored by
    `reward_fn`. Past `max_turns` the episode ends with reward 0."""

    def __init__(self, *, tools: ToolSet, reward_fn: RewardFn, max_turns: int = 8):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.tools = tools
        self.reward_fn = reward_fn
        self.max_turns = max_turns
        self.task: Task | None = None
        self.turns = 0
        self.done = False
        self.reward: float | None = None
        self.answer: str | None = None

    async def reset(self, task: Task | None = None, *, seed: int = 0) -> Observation:
        self.task = task if task is not None else self.sample_task(seed)
        self.turns, self.done, self.reward, self.answer = 0, False, None, None
        return Observation(text=self.task.prompt, system=self.system_prompt, task=self.task)

    async def step(self, action: AgentAction) -> StepResult:
        if self.task is None or self.done:
            raise RuntimeError("step() before reset() or after the episode ended")
        self.turns += 1
        if not action.tool_calls and not action.parse_errors:
            self.answer = action.content
            self.reward = await self._score(action.content)
            self.done = True
            return StepResult(messages=(), reward=self.reward, done=True, info=self._info())
        results = await self.tools.call_all(action.tool_calls, action.parse_errors)
        messages = tuple(r.message() for r in results)
        if self.turns >= self.max_turns:
            self.done, self.reward = True, 0.0
        return StepResult(
            messages=messages, reward=self.reward, done=self.done,
            info={**self._info(), "tool_errors": [r.error_kind for r in results if not r.ok]},
        )  # fmt: skip

    async def _score(self, answer: str) -> float:
        assert self.task is not None
        value = self.reward_fn(self.task, answer)
        if inspect.isawaitable(value):
            value = await value
        return float(value)

    async def final_reward(self) -> float:
        return self.reward if self.reward is not None else 0.0

    def _info(self) -> dict[str, Any]:
        return {"turns": self.turns, "finished": self.done and self.answer is not None}
