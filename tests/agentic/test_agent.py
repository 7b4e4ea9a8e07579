"""Agent episodes on a real engine (tiny Qwen3, vocabulary of the char tokenizer): the trajectory is
exactly what the engine saw, masks and versions are right, only new tokens are prefilled, chat
observations are tokenized once, and failures and limits end one episode, not the run."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from nonstop.agentic.agent import Agent, derive_seed
from nonstop.agentic.config import AgentConfig
from nonstop.agentic.environment import AgentAction, Environment, Observation, StepResult, Task
from nonstop.agentic.parsers import get_parser
from nonstop.agentic.tools import ToolSet
from nonstop.agentic.trajectory_builder import ChatInteraction, ScriptedToolInteraction
from nonstop.engine import Engine, EngineConfig, SamplingParams
from nonstop.models import Message, ModelConfig, init_decoder
from nonstop.models.char_tokenizer import char_tokenizer

TOKENIZER = char_tokenizer("qwen")
VOCAB = TOKENIZER.vocab_size  # 101
TURN = 7
CONFIG = AgentConfig(max_turns=5, max_tokens_per_turn=TURN, ignore_eos=True,
                     sampling=SamplingParams(temperature=1.0))


@pytest.fixture(scope="module")
def engine():
    model = init_decoder(ModelConfig.tiny("qwen3", vocab_size=VOCAB), seed=3)
    with Engine(model, EngineConfig(max_slots=5, max_len=128, prefill_chunks=(8, 32))) as e:
        yield e


def _tool(latency_s: float = 0.0, fail_on_turn: int | None = None):
    async def tool(turn, sampled):
        await asyncio.sleep(latency_s)
        if turn == fail_on_turn:
            raise ConnectionError("tool backend unreachable")
        return [10 + turn, 11 + turn, 12 + turn]  # 3 observation ids

    return tool


def _scripted(turns=3, **tool_kwargs):
    return ScriptedToolInteraction([5, 6, 7, 8, 9], num_turns=turns, tool=_tool(**tool_kwargs),
                                   reward_fn=lambda answer: float(np.mean(answer)))


def _run(coro):
    return asyncio.run(coro)


def test_trajectory_is_what_the_engine_saw_at_every_turn(engine):
    agent = Agent(engine, CONFIG)
    t = _run(agent.run_episode(_scripted(3), group_id=2, episode_id=7, seed=123))
    log = t.info["turn_log"]
    assert t.info["status"] == "done" and t.info["turns"] == 3 and len(log) == 3
    # Layout by hand: prompt 5, then (7 sampled + 3 tool) twice, then the 7-token answer.
    assert len(t) == 5 + 7 + 3 + 7 + 3 + 7
    sampled = np.zeros(len(t), bool)
    for start in (5, 15, 25):
        sampled[start:start + TURN] = True
    np.testing.assert_array_equal(t.loss_mask, sampled)
    np.testing.assert_array_equal(t.tokens[12:15], [11, 12, 13])
    np.testing.assert_array_equal(t.tokens[22:25], [12, 13, 14])
    np.testing.assert_array_equal(t.policy_version, np.where(sampled, 0, -1))
    assert np.all(t.behavior_logprobs[~sampled] == 0) and np.all(t.behavior_logprobs[sampled] < 0)
    assert t.reward == pytest.approx(float(np.mean(t.tokens[25:32])))
    assert t.min_version == 0 and t.group_id == 2 and t.episode_id == 7
    for turn, entry in enumerate(log):
        n = entry["prompt_length"]
        assert n == (5, 15, 25)[turn] and entry["seed"] == derive_seed(123, turn)
        # Replay without a session: the prefix it was given and its seed give the same turn.
        replay = engine.generate_sync(t.tokens[:n], SamplingParams(max_tokens=TURN,
                                                                   seed=entry["seed"]))
        np.testing.assert_array_equal(replay.tokens, t.tokens[n:n + TURN])
        np.testing.assert_allclose(replay.logprobs, t.behavior_logprobs[n:n + TURN], atol=1e-5)
        if turn:  # the session kept the cache: only the last sampled id and the tool ids ran
            assert entry["prefilled"] == 1 + 3 and entry["cached"] == n - 4


def test_chat_observations_are_tokenized_once_and_model_ids_kept_verbatim(engine):
    class FeedbackEnv(Environment):
        """Answers every turn with a user message; ends after three turns."""

        tools = ToolSet()

        def sample_task(self, seed: int) -> Task:
            return Task(prompt=f"Count to {seed}.", answer=str(seed))

        async def reset(self, task=None, *, seed=0):
            self.turns = 0
            return Observation(text=self.sample_task(seed).prompt, system="Be brief.")

        async def step(self, action: AgentAction) -> StepResult:
            self.turns += 1
            done = self.turns == 3
            return StepResult(messages=() if done else (Message.user(f"Again {self.turns}"),),
                              reward=1.0 if done else None, done=done)

        async def final_reward(self) -> float:
            return float(self.turns)

    config = AgentConfig(max_turns=5, max_tokens_per_turn=6,
                         sampling=SamplingParams(stop_token_ids=TOKENIZER.eos_ids))
    interaction = ChatInteraction(FeedbackEnv(), TOKENIZER, get_parser("qwen"),
                                  template="qwen", seed=4)
    t = _run(Agent(engine, config).run_episode(interaction, group_id=0, episode_id=0, seed=9))
    conversation = interaction.conversation
    assert t.info["status"] == "done" and t.info["turns"] == 3 and t.reward == 3.0
    np.testing.assert_array_equal(t.tokens, conversation.tokens)
    np.testing.assert_array_equal(t.loss_mask, conversation.loss_mask)
    assert "Again 2" in TOKENIZER.decode(conversation.tokens)
    # The system and user text went in as the template renders them, tokenized once.
    opening = TOKENIZER.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                               "Count to 4.<|im_end|>\n<|im_start|>assistant\n")
    np.testing.assert_array_equal(t.tokens[:len(opening)], opening)


def test_a_failing_tool_fails_only_its_episode(engine):
    agent = Agent(engine, CONFIG)

    async def main():
        return await asyncio.gather(
            agent.run_episode(_scripted(3), group_id=0, episode_id=0, seed=1),
            agent.run_episode(_scripted(3, fail_on_turn=2), group_id=0, episode_id=1, seed=2),
            agent.run_episode(_scripted(3), group_id=0, episode_id=2, seed=3))

    ok, failed, ok2 = _run(main())
    assert ok.info["status"] == ok2.info["status"] == "done"
    assert failed.info["status"] == "error" and failed.reward == 0.0
    assert "ConnectionError: tool backend unreachable" in failed.info["error"]
    assert failed.info["turns"] == 2  # it failed in the tool after its second turn
    assert engine.stats().active_slots == 0


def test_limits_end_episodes_with_their_reason(engine):
    def run(config, interaction):
        return _run(Agent(engine, config).run_episode(interaction, group_id=0, episode_id=0,
                                                      seed=5))

    t = run(AgentConfig(max_turns=2, max_tokens_per_turn=TURN, ignore_eos=True), _scripted(4))
    assert t.info["status"] == "max_turns" and t.num_sampled == 2 * TURN
    t = run(AgentConfig(max_turns=5, max_tokens_per_turn=TURN, max_episode_tokens=10,
                        ignore_eos=True), _scripted(4))
    assert t.info["status"] == "max_tokens" and t.num_sampled == 10  # 7, then the 3 left
    t = run(AgentConfig(max_turns=5, max_tokens_per_turn=TURN, max_context_tokens=20,
                        ignore_eos=True), _scripted(4))
    assert t.info["status"] == "context_full" and len(t) <= 20
    # Wall clock: the second tool call takes 5 s, the episode may take 0.5 s.
    slow_second_call = ScriptedToolInteraction(
        [5, 6], num_turns=3, reward_fn=lambda a: 1.0,
        tool=lambda turn, s: asyncio.sleep(0.0 if turn == 1 else 5.0, [1, 2]))
    t = run(AgentConfig(max_turns=5, max_tokens_per_turn=TURN, ignore_eos=True,
                        episode_timeout_s=0.5), slow_second_call)
    assert t.info["status"] == "timeout" and t.info["turns"] == 2 and t.num_sampled == 2 * TURN
    # A hung environment step (tools included) fails the episode.
    t = run(AgentConfig(max_turns=5, max_tokens_per_turn=TURN, ignore_eos=True,
                        step_timeout_s=0.2), _scripted(3, latency_s=5.0))
    assert t.info["status"] == "error" and "StepTimeoutError" in t.info["error"]
