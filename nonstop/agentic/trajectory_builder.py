"""The token stream of an episode: what is appended around each sampled turn, and by whom.

An `Interaction` is the episode's counterpart at the token level. The `Agent` asks it for the
opening context, then after every model turn hands it the sampled ids and appends the ids it
returns (template closing text, tool results, the next generation header). Only the Agent ever
appends to the trajectory, and it appends exactly the ids the engine sampled, so the trajectory
is, turn after turn, the very context the engine was given: token in, token out.

- `ChatInteraction`: an `Environment` behind a chat template. The `Conversation` renders and
  tokenizes each observation once (only the text the template adds), and takes the model's ids
  verbatim; the decoded text is used only to parse tool calls.
- `ScriptedToolInteraction`: a fixed number of turns with a tool call after each turn but the
  last, at the token level (the benchmarks' agent: a random model cannot write tool calls).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from nonstop import perf
from nonstop.agentic.environment import AgentAction, Environment, Task
from nonstop.agentic.parsers import ToolCallParser
from nonstop.engine import FinishReason
from nonstop.models import ChatTemplate, Conversation, Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class TurnResult:
    """What follows a model turn: ids to append (never trained) and whether the episode ended."""

    tokens: Sequence[int]
    done: bool
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Interaction(abc.ABC):
    """One episode's counterpart. `start` once, `step` after each model turn, `reward` at the end."""

    @abc.abstractmethod
    async def start(self) -> Sequence[int]:
        """The opening context: every id up to where the model starts generating."""

    @abc.abstractmethod
    async def step(self, sampled: Sequence[int], finish_reason: FinishReason) -> TurnResult:
        """React to the model's turn (run tools, step the environment)."""

    @abc.abstractmethod
    async def reward(self) -> float:
        """The episode's reward, once it ended (also when it was cut off)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the episode holds (called once, whatever happened)."""


class ChatInteraction(Interaction):
    """An `Environment` episode through a chat template and a tool-call parser."""

    def __init__(self, env: Environment, tokenizer: Tokenizer, parser: ToolCallParser, *,
                 template: ChatTemplate | str | None = None, task: Task | None = None,
                 seed: int = 0, with_tools: bool = True) -> None:
        self.env = env
        self.tokenizer = tokenizer
        self.parser = parser
        self.task = task
        self.seed = seed
        tools = env.tools.schemas() if with_tools and len(env.tools) else None
        self.conversation = Conversation(tokenizer, template, tools=tools)
        self._emitted = 0  # ids handed out so far (the conversation plus a generation header)
        self.actions: list[AgentAction] = []

    async def start(self) -> Sequence[int]:
        observation = await self.env.reset(self.task, seed=self.seed)
        self.conversation.append_messages(observation.messages())
        return self._next_prompt(0)

    def _next_prompt(self, emitted_before: int) -> list[int]:
        """The ids from `emitted_before` to the end of the next generation prompt."""
        prompt = self.conversation.generation_prompt_tokens()
        self._emitted = len(prompt)
        return prompt[emitted_before:]

    async def step(self, sampled: Sequence[int], finish_reason: FinishReason) -> TurnResult:
        conversation, emitted = self.conversation, self._emitted
        before = len(conversation)
        added = conversation.append_model_tokens(sampled)
        header = emitted - before
        if list(added[header:header + len(sampled)]) != list(sampled):
            raise RuntimeError("the conversation did not append the sampled ids verbatim")
        closing = list(added[header + len(sampled):])
        action = AgentAction.from_text(self.tokenizer.decode(list(sampled)), self.parser)
        self.actions.append(action)
        result = await self.env.step(action)
        observation = conversation.append_messages(result.messages) if result.messages else []
        if result.done:
            self._emitted = len(conversation)
            return TurnResult(tokens=closing + list(observation), done=True, info=result.info)
        header_ids = self._next_prompt(len(conversation))
        return TurnResult(tokens=closing + list(observation) + header_ids, done=False,
                          info=result.info)

    async def reward(self) -> float:
        return float(await self.env.final_reward())

    def close(self) -> None:
        self.env.close()


ScriptedTool = Callable[[int, Sequence[int]], Awaitable[Sequence[int]]]
AnswerReward = Callable[[Sequence[int]], float]


class ScriptedToolInteraction(Interaction):
    """`num_turns` model turns; after each but the last, `tool(turn, sampled)` is awaited and its
    ids appended; the reward is `reward_fn(last turn's ids)`. The tool's time is recorded as
    `rollout/tool_wait`."""

    def __init__(self, prompt: Sequence[int], *, num_turns: int, tool: ScriptedTool,
                 reward_fn: AnswerReward) -> None:
        if num_turns < 1:
            raise ValueError(f"ScriptedToolInteraction.num_turns = {num_turns!r} is not valid; "
                             "valid: an int >= 1")
        if not prompt:
            raise ValueError("ScriptedToolInteraction.prompt is empty; valid: at least one id")
        self.prompt = [int(t) for t in prompt]
        self.num_turns = num_turns
        self.tool = tool
        self.reward_fn = reward_fn
        self.turns = 0
        self.answer: list[int] = []
        self.tool_calls = 0

    async def start(self) -> Sequence[int]:
        return self.prompt

    async def step(self, sampled: Sequence[int], finish_reason: FinishReason) -> TurnResult:
        self.turns += 1
        self.answer = list(sampled)
        if self.turns >= self.num_turns:
            return TurnResult(tokens=(), done=True)
        with perf.span(perf.ROLLOUT_TOOL_WAIT, tool="scripted", turn=self.turns):
            observation = await self.tool(self.turns, sampled)
        self.tool_calls += 1
        return TurnResult(tokens=[int(t) for t in observation], done=False,
                          info={"tool_calls": self.tool_calls})

    async def reward(self) -> float:
        return float(self.reward_fn(self.answer))
