"""Environments written with `verifiers` and with OpenEnv, defined here with each library's own
classes (no network, no downloaded data), run by nonstop's Agent on a real engine: the same
episode checks as a native environment (the trajectory is the conversation's tokens, masks and
versions exactly on the sampled ids, tool results between turns, the library's reward), episodes
interleaving while tools wait, and a few agentic GRPO steps through `nonstop agentic`'s recipe."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest
import verifiers.v1 as vf
from fastmcp import FastMCP
from openenv.core.env_server.interfaces import Environment as OpenEnvironment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics.base import Rubric

from nonstop import perf
from nonstop.agentic.agent import Agent
from nonstop.agentic.config import AgentConfig
from nonstop.agentic.environment import AgentAction
from nonstop.agentic.hubs.common import HELD_OUT_SEED
from nonstop.agentic.hubs.openenv_env import OpenEnvEnv
from nonstop.agentic.hubs.verifiers_env import VerifiersEnv
from nonstop.agentic.parsers import ParsedTurn
from nonstop.agentic.trajectory_builder import ChatInteraction
from nonstop.engine import Engine, EngineConfig, SamplingParams
from nonstop.models import ModelConfig, init_decoder
from nonstop.models.char_tokenizer import char_tokenizer
from nonstop.models.chat import ToolCall
from nonstop.recipes.agentic_recipe import EVAL_SEED_OFFSET, AgenticRunConfig, run_agentic
from nonstop.recipes.config_io import load_config

TOKENIZER = char_tokenizer("qwen")
CONFIGS = Path(__file__).resolve().parents[2] / "nonstop" / "recipes" / "configs"

# ------------------------------------------------------------------------------ verifiers


class CalcTools(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        await asyncio.sleep(SLOW_TOOL_S.get(a, 0.0))
        return a + b


SLOW_TOOL_S: dict[int, float] = {}  # tool latency by first operand (the interleaving test)


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def used_a_tool(self, trace) -> float:
        return float(len(trace.tool_messages) > 0)

    @vf.metric
    async def turns(self, trace) -> float:
        return float(trace.num_turns)


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        for i in range(6):
            yield SumTask(SumData(prompt=f"{i}+1?", answer=str(i + 1), system_prompt="Add."))

    @classmethod
    def toolsets(cls, config):
        return [CalcTools(vf.ToolsetConfig())]


class BriefTask(SumTask):
    @vf.reward
    async def brief(self, trace) -> float:
        """Shorter answers score higher: rewards that differ within a group of a random model."""
        return 1.0 / (1.0 + len(trace.last_reply))


class BriefTaskset(vf.Taskset[BriefTask]):
    def load(self):
        for i in range(6):
            yield BriefTask(SumData(prompt=f"{i}+1?", answer=str(i + 1)))


class StopAfterOneTool(SumTask):
    @vf.stop
    async def one_tool_result(self, trace: vf.Trace) -> bool:
        return len(trace.tool_messages) >= 1


class StoppingTaskset(vf.Taskset[StopAfterOneTool]):
    def load(self):
        yield StopAfterOneTool(SumData(prompt="1+1?", answer="2"))

    @classmethod
    def toolsets(cls, config):
        return [CalcTools(vf.ToolsetConfig())]


# ------------------------------------------------------------------------------ OpenEnv


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str


class QuarterPerGuess(Rubric):
    """0.25 for every non-empty guess (a deterministic score for a random model)."""

    def forward(self, action, observation) -> float:
        return 0.25 if action.guess.strip() else 0.0


class GuessEnv(OpenEnvironment[GuessAction, GuessObservation, State]):
    """Three guesses at a number; feedback after each."""

    def __init__(self, guesses: int = 3):
        super().__init__(rubric=QuarterPerGuess())
        self.guesses = guesses
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(feedback=f"Guess my number ({seed}).")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        observation = GuessObservation(feedback=f"No ({self._state.step_count}).",
                                       done=self._state.step_count >= self.guesses)
        observation.reward = self._apply_rubric(action, observation)
        return observation

    @property
    def state(self):
        return self._state


class SubmitRubric(Rubric):
    def forward(self, action, observation) -> float:
        return 1.0 if getattr(action, "tool_name", "") == "submit" else 0.0


class CalcMCPEnv(MCPEnvironment):
    """Tools on a FastMCP server; `submit` scores 1 through the rubric."""

    def __init__(self):
        mcp = FastMCP("calc")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool()
        def submit(answer: int) -> str:
            """Submit the final answer."""
            return f"submitted {answer}"

        super().__init__(mcp)
        self.rubric = SubmitRubric()
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        return Observation(metadata={"task": f"Add 2 and {seed}, then submit."})

    async def step_async(self, action, timeout_s=None, **kwargs):
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        observation.reward = await self._apply_rubric_async(action, observation)
        return observation

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Observation()

    @property
    def state(self):
        return self._state


class MoveAction(Action):
    """Move by (dx, dy) on the grid."""

    dx: int
    dy: int


class PositionObservation(Observation):
    x: int
    y: int


class WalkEnv(OpenEnvironment[MoveAction, PositionObservation, State]):
    """Reach (1, 1): -0.1 a move, 1 on arrival."""

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.x = self.y = 0
        return PositionObservation(x=0, y=0)

    def step(self, action, timeout_s=None, **kwargs):
        self.x, self.y = self.x + action.dx, self.y + action.dy
        arrived = (self.x, self.y) == (1, 1)
        return PositionObservation(x=self.x, y=self.y, done=arrived,
                                   reward=1.0 if arrived else -0.1)

    @property
    def state(self):
        return State()


# ------------------------------------------------------------------------------ episodes


class ScriptedCalls:
    """A parser whose turn k makes the calls `script[k]` whatever the model wrote (a random
    model cannot write tool calls); the text itself is kept as the turn's content."""

    def __init__(self, *script: tuple[ToolCall, ...]):
        self.script = list(script)

    def parse(self, text: str) -> ParsedTurn:
        calls = self.script.pop(0) if self.script else ()
        return ParsedTurn(content=text, tool_calls=calls)


@pytest.fixture(scope="module")
def engine():
    model = init_decoder(ModelConfig.tiny("qwen3", vocab_size=TOKENIZER.vocab_size), seed=5)
    with Engine(model, EngineConfig(max_slots=6, max_len=512, prefill_chunks=(16, 64))) as e:
        yield e


CONFIG = AgentConfig(max_turns=5, max_tokens_per_turn=8, ignore_eos=True,
                     sampling=SamplingParams(temperature=1.0))


def run_episode(engine, env, parser, *, seed=0, task_seed=0, agent_config=CONFIG):
    interaction = ChatInteraction(env, TOKENIZER, parser, template="qwen",
                                  task=env.sample_task(task_seed), seed=seed, with_tools=False)
    trajectory = asyncio.run(Agent(engine, agent_config).run_episode(
        interaction, group_id=0, episode_id=seed, seed=seed))
    return trajectory, interaction


def check_token_in_token_out(trajectory, interaction, turns):
    """The trajectory is the conversation's ids; masks, log-probs and versions mark exactly the
    sampled ids; what sits between two sampled turns is the rendered observation."""
    conversation = interaction.conversation
    np.testing.assert_array_equal(trajectory.tokens, conversation.tokens)
    np.testing.assert_array_equal(trajectory.loss_mask, conversation.loss_mask)
    sampled = trajectory.loss_mask
    assert trajectory.info["turns"] == turns
    assert sampled.sum() == sum(e["sampled"] for e in trajectory.info["turn_log"])
    np.testing.assert_array_equal(trajectory.policy_version, np.where(sampled, 0, -1))
    assert np.all(trajectory.behavior_logprobs[~sampled] == 0)
    assert np.all(trajectory.behavior_logprobs[sampled] < 0)
    starts = [e["prompt_length"] for e in trajectory.info["turn_log"]]
    between = [TOKENIZER.decode(list(trajectory.tokens[a + CONFIG.max_tokens_per_turn:b]))
               for a, b in zip(starts, starts[1:], strict=False)]
    for turn, start in enumerate(starts):  # each turn was sampled from the whole context
        assert sampled[start:start + CONFIG.max_tokens_per_turn].all(), turn
    return between


def test_verifiers_episode_keeps_tokens_masks_and_scores_with_the_tasks_rubric(engine):
    env = VerifiersEnv(SumTaskset)
    parser = ScriptedCalls((ToolCall(name="calc_tools_add", arguments={"a": 2, "b": 1},
                                     id="c0"),), ())
    trajectory, interaction = run_episode(engine, env, parser, task_seed=2)
    assert trajectory.info["status"] == "done"
    between = check_token_in_token_out(trajectory, interaction, turns=2)
    assert "<tool_response>\n3\n</tool_response>" in between[0]
    assert TOKENIZER.decode(list(trajectory.tokens[:40])).startswith(
        "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n2+1?<|im_end|>")
    # The library scored the trace it was given: used a tool (0.5 x 1), the random answer wrong.
    assert env.trace.rewards == {"correct": vf.Reward(score=0.0, weight=1.0),
                                 "used_a_tool": vf.Reward(score=1.0, weight=0.5)}
    assert trajectory.reward == 0.5 and env.trace.metrics == {"turns": 2.0}
    assert [type(m).__name__ for m in env.trace.messages] == [
        "SystemMessage", "UserMessage", "AssistantMessage", "ToolMessage", "AssistantMessage"]
    assert env.trace.assistant_messages[-1].content == interaction.actions[-1].content


def test_verifiers_stop_hooks_and_tool_errors(engine):
    env = VerifiersEnv(StoppingTaskset)
    bad = ToolCall(name="calc_tools_add", arguments={"a": "two"}, id="c1")
    good = ToolCall(name="calc_tools_add", arguments={"a": 1, "b": 1}, id="c2")
    trajectory, interaction = run_episode(engine, env, ScriptedCalls((bad, good)))
    assert trajectory.info["status"] == "done" and trajectory.info["turns"] == 1
    assert env.trace.stop_condition == "one_tool_result"
    assert trajectory.info["last_step_info"]["tool_errors"] == ["bad_arguments"]
    assert trajectory.reward == 0.5  # used a tool; never answered


def test_openenv_text_actions_episode(engine):
    env = OpenEnvEnv(GuessEnv, system_prompt="Play.")
    trajectory, interaction = run_episode(engine, env, ScriptedCalls(), seed=4, task_seed=4)
    assert trajectory.info["status"] == "done"
    between = check_token_in_token_out(trajectory, interaction, turns=3)
    assert "<|im_start|>user\nNo (1).<|im_end|>" in between[0]
    assert "<|im_start|>user\nNo (2).<|im_end|>" in between[1]
    assert "Guess my number (4)." in TOKENIZER.decode(list(trajectory.tokens))
    assert trajectory.reward == pytest.approx(0.75)  # the rubric's 0.25 per guess, summed


def test_openenv_mcp_tools_episode(engine):
    env = OpenEnvEnv(CalcMCPEnv)
    parser = ScriptedCalls((ToolCall(name="add", arguments={"a": 2, "b": 3}, id="c0"),),
                           (ToolCall(name="submit", arguments={"answer": 5}, id="c1"),), ())
    trajectory, interaction = run_episode(engine, env, parser, task_seed=3)
    assert trajectory.info["status"] == "done"
    between = check_token_in_token_out(trajectory, interaction, turns=3)
    assert "<tool_response>\n5\n</tool_response>" in between[0]
    assert "<tool_response>\nsubmitted 5\n</tool_response>" in between[1]
    assert '{"task": "Add 2 and 3, then submit."}' in TOKENIZER.decode(list(trajectory.tokens))
    assert trajectory.reward == 1.0 and env.rewards == [0.0, 1.0]


def test_openenv_prompt_override_and_held_out_seeds():
    env = OpenEnvEnv(GuessEnv, env_args={"guesses": 2}, prompt="Find it.")
    assert env.text_field == "guess"
    assert env.sample_task(HELD_OUT_SEED + 1).info == {"seed": HELD_OUT_SEED + 1,
                                                       "split": "eval"}
    assert HELD_OUT_SEED == EVAL_SEED_OFFSET  # the recipe's held-out seeds are the adapters'

    async def main():
        observation = await env.reset(seed=1)
        return observation.messages()

    assert [m.content for m in asyncio.run(main())] == ["Find it."]
    env.close()


def test_openenv_action_of_several_fields_is_one_tool():
    env = OpenEnvEnv(WalkEnv, action_tool="move", reward="sum")
    moves = [ToolCall(name="move", arguments={"dx": 1, "dy": 0}, id="a"),
             ToolCall(name="move", arguments={"dx": 0, "dy": 1}, id="b")]

    async def main():
        opening = await env.reset(seed=0)
        wrong = await env.step(AgentAction.calls(
            ToolCall(name="move", arguments={"dx": "left"}, id="c")))
        step = await env.step(AgentAction.calls(*moves))
        return opening, wrong, step

    opening, wrong, step = asyncio.run(main())
    env.close()
    (schema,) = env.tools.schemas()
    assert schema["function"]["name"] == "move"
    assert schema["function"]["description"] == "Move by (dx, dy) on the grid."
    assert schema["function"]["parameters"]["required"] == ["dx", "dy"]
    assert "metadata" not in schema["function"]["parameters"]["properties"]
    assert opening.text == '{"x": 0, "y": 0}'
    assert wrong.info["tool_errors"] == ["bad_arguments"] and not wrong.done
    assert [m.content for m in step.messages] == ['{"x": 1, "y": 0}', '{"x": 1, "y": 1}']
    assert step.done and step.reward == pytest.approx(0.9)  # -0.1 + 1.0


def test_hub_episodes_interleave_while_their_tools_wait(engine):
    """Three verifiers episodes whose tool sleeps 0.1, 0.3 and 0.5 s: while the slowest waits
    the engine decodes the others' turns, and the whole takes far less than one after another."""
    SLOW_TOOL_S.update({10: 0.1, 11: 0.3, 12: 0.5})

    async def one(i):
        env = VerifiersEnv(SumTaskset)
        call = ToolCall(name="calc_tools_add", arguments={"a": 10 + i, "b": 1}, id="c")
        parser = ScriptedCalls((call,), (call,), ())
        interaction = ChatInteraction(env, TOKENIZER, parser, template="qwen",
                                      task=env.sample_task(i), seed=i, with_tools=False)
        return await Agent(engine, CONFIG).run_episode(interaction, group_id=0, episode_id=i,
                                                       seed=i)

    async def main():
        with perf.span("test/hub_window") as window:
            t0 = time.perf_counter()
            trajectories = await asyncio.gather(*(one(i) for i in range(3)))
            wall = time.perf_counter() - t0
        return trajectories, wall, window.id

    try:
        trajectories, wall, window_id = asyncio.run(main())
    finally:
        SLOW_TOOL_S.clear()
    assert all(t.info["status"] == "done" and t.reward == 0.5 for t in trajectories)
    events = perf.current().events()
    window = next(e for e in events if e.id == window_id)
    inside = [e for e in events if window.t0 <= e.t0 and e.t1 <= window.t1]
    waits = sorted((e for e in inside if e.name == perf.ROLLOUT_TOOL_WAIT),
                   key=lambda e: e.duration_ns)
    decodes = [e for e in inside if e.name == perf.ROLLOUT_DECODE]
    assert len(waits) == 6
    assert sum(waits[-1].t0 <= d.t0 and d.t1 <= waits[-1].t1 for d in decodes) >= 1
    assert wall < 0.8 * 2 * (0.1 + 0.3 + 0.5)  # serially the tools alone take 1.8 s


# ------------------------------------------------------------------------------ GRPO steps

TINY = ["steps=2", "num_eval=2", "group_size=2", "groups_per_step=2", "max_concurrency=8",
        "engine.max_slots=8", "agent.max_tokens_per_turn=12", "agent.max_turns=2",
        "model.num_layers=1", "model.hidden_size=32", "model.head_dim=8"]


@pytest.mark.parametrize("env_args", [
    ["env.path=nonstop.agentic.hubs.verifiers_env:VerifiersEnv",
     "env.args={taskset: 'tests.agentic.test_hubs:BriefTaskset', eval_fraction: null}"],
    ["env.path=nonstop.agentic.hubs.openenv_env:OpenEnvEnv",
     "env.args={env: 'tests.agentic.test_hubs:GuessEnv', env_args: {guesses: 2}}"],
], ids=["verifiers", "openenv"])
def test_agentic_grpo_steps_on_a_hub_environment(tmp_path, env_args):
    cfg = load_config(AgenticRunConfig, CONFIGS / "agentic_calculator_tiny.yaml",
                      [f"run_dir={tmp_path}", *TINY, *env_args])
    summary = run_agentic(cfg, progress=False)
    assert summary["steps"] == 2
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(np.isfinite(m["reward_mean"]) for m in metrics)
    if "openenv" in env_args[0]:  # two non-empty guesses of 0.25 each, whatever the model says
        assert summary["solve_rate_before"] == pytest.approx(0.5)
    else:  # the taskset's `brief` reward, in (0, 1], reached the learner
        assert all(0.0 < m["reward_mean"] <= 1.0 for m in metrics)
