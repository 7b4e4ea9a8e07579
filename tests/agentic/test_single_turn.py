"""Single-turn RL through the agentic pipeline (tiny Qwen3, char tokenizer, arithmetic prompts):
at max_staleness 0 the streaming learner reproduces the synchronous collect-then-train learner's
losses and parameters bit for bit, for GRPO and for PPO; rewards follow reward_on_error; group g
answers the stream's g-th example."""

from __future__ import annotations

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nonstop.agentic.config import AgentConfig, OrchestratorConfig, StreamingLearnerConfig
from nonstop.agentic.orchestrator import EpisodeSpec, RolloutOrchestrator
from nonstop.agentic.single_turn import ExampleStream, PromptEpisodes
from nonstop.agentic.streaming import (
    EpisodesFailingError,
    NoVarianceError,
    StreamingLearner,
    SyncLearner,
)
from nonstop.engine import Engine, EngineConfig, SamplingParams
from nonstop.models import ModelConfig, init_decoder
from nonstop.models.char_tokenizer import char_tokenizer
from nonstop.recipes.tasks import ArithmeticTask
from nonstop.rl import RLAlgorithmConfig
from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
from nonstop.rl.prompts import answer_text, encode_prompt
from nonstop.rl.rewards import Example, Reward, RewardError
from nonstop.train import OptimizerConfig, PackingConfig

G, B, NEW = 3, 2, 5
TOKENIZER = char_tokenizer()


def digit_share(prompt: str, completion: str, example: Example) -> float:
    """A reward a random model's samples vary on: the share of digits in the completion."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def _episodes(reward: Reward | None = None, on_error: str = "skip") -> PromptEpisodes:
    stream = ExampleStream(ArithmeticTask(digits=2).iter_examples("train", 0))
    return PromptEpisodes(TOKENIZER, stream, reward or Reward("digits", digit_share),
                          reward_on_error=on_error)


def _config(**kw) -> StreamingLearnerConfig:
    agent = AgentConfig(max_turns=1, max_tokens_per_turn=NEW, max_episode_tokens=NEW,
                        step_timeout_s=None,
                        sampling=SamplingParams(stop_token_ids=tuple(TOKENIZER.eos_ids)))
    return StreamingLearnerConfig(groups_per_step=B, max_staleness=0, **kw,
                                  orchestrator=OrchestratorConfig(group_size=G, max_concurrency=8,
                                                                  seed=5, agent=agent))


@pytest.fixture(scope="module")
def model():
    return init_decoder(ModelConfig.tiny("qwen3", vocab_size=TOKENIZER.vocab_size), seed=3)


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model, EngineConfig(max_slots=8, max_len=32, prefill_chunks=(8, 32))) as engine:
        yield engine


def _trainer(model, algorithm: RLAlgorithmConfig) -> PolicyTrainer:
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    return PolicyTrainer(copy, PolicyTrainerConfig(
        algorithm=algorithm,
        optimizer=OptimizerConfig(learning_rate=3e-3, schedule="constant", weight_decay=0.0),
        packing=PackingConfig(buckets=(32,), rows_per_batch=B * G, max_segments_per_row=2)))


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_staleness_0_reproduces_the_synchronous_learner(model, engine, name):
    algorithm = RLAlgorithmConfig.for_run(name, budget=NEW, kl_coef=None)
    trainer = _trainer(model, algorithm)
    initial_state = jax.tree.map(jnp.copy, trainer.state)
    initial_critic = (jax.tree.map(jnp.copy, trainer.critic.state)
                      if trainer.critic is not None else None)
    initial_params = jax.tree.map(jnp.copy, nnx.state(model))
    steps = 3

    def run(cls):
        trainer.state = jax.tree.map(jnp.copy, initial_state)
        trainer.steps_taken = 0
        if initial_critic is not None:
            trainer.critic.state = jax.tree.map(jnp.copy, initial_critic)
        engine.update_weights(initial_params, version=0)
        engine.generate_sync([5, 6], SamplingParams(max_tokens=1))  # the update applies first
        hooked = []

        async def on_step(record):
            hooked.append(record.version)

        learner = cls(trainer, engine, _episodes(), _config(), on_step=on_step)
        records = asyncio.run(learner.run(steps))
        assert hooked == list(range(steps))
        return records, jax.tree.leaves(jax.tree.map(np.asarray, trainer.state.params))

    sync_records, sync_params = run(SyncLearner)
    stream_records, stream_params = run(StreamingLearner)
    for a, b in zip(sync_records, stream_records, strict=True):
        assert a.group_ids == b.group_ids == tuple(range(a.version * B, a.version * B + B))
        assert a.metrics["loss"] == b.metrics["loss"]  # bit for bit
        assert a.reward_mean == b.reward_mean and set(b.staleness) == {0}
        assert 0 < b.completion_tokens <= NEW
    if name == "ppo":
        assert all("value_loss" in r.metrics for r in stream_records)
    assert all(np.array_equal(x, y) for x, y in zip(sync_params, stream_params, strict=True))
    start = jax.tree.leaves(jax.tree.map(np.asarray, initial_state.params))
    assert any(not np.array_equal(x, y) for x, y in zip(start, stream_params, strict=True))


def test_group_g_answers_the_g_th_example_and_the_reward_sees_the_answer_text(engine):
    episodes = _episodes()
    stream = list(zip(range(6), ArithmeticTask(digits=2).iter_examples("train", 0), strict=False))
    orchestrator = RolloutOrchestrator(engine, episodes, _config().orchestrator)
    groups = asyncio.run(orchestrator.run_groups([4, 1]))
    for gid, trajectories in groups.items():
        prompt = encode_prompt(TOKENIZER, stream[gid][1].prompt, "raw", False)
        for t in trajectories:
            assert list(t.tokens[:t.prompt_length]) == prompt
            text = answer_text(TOKENIZER, t.tokens[t.prompt_length:])
            assert t.reward == digit_share("", text, stream[gid][1])
            assert t.info["status"] == "done" and t.num_sampled <= NEW
    assert episodes.examples.consumed == 5  # resume continues at group 5
    window = ExampleStream(ArithmeticTask(digits=2).iter_examples("train", 0), window=2)
    assert window[5] == stream[5][1]
    with pytest.raises(IndexError, match="example 1 was dropped from the window"):
        window[1]


def _broken(prompt: str, completion: str, example: Example) -> float:
    raise ValueError("no scorer")


def test_reward_on_error(model, engine):
    async def run_one(on_error: str):
        episodes = _episodes(Reward("broken", _broken), on_error)
        orchestrator = RolloutOrchestrator(engine, episodes, _config().orchestrator)
        groups = await orchestrator.run_groups([0])
        return episodes, groups[0]

    episodes, zero = asyncio.run(run_one("zero"))
    assert [t.reward for t in zero] == [0.0] * G and {t.info["status"] for t in zero} == {"done"}
    assert episodes.failures == {"broken/exception": G}
    episodes, skipped = asyncio.run(run_one("skip"))  # failed episodes: the queue drops the group
    assert {t.info["status"] for t in skipped} == {"error"}
    assert "no scorer" in skipped[0].info["error"]

    trainer = _trainer(model, RLAlgorithmConfig.grpo())

    async def learner_stops():
        episodes = _episodes(Reward("broken", _broken), "raise")
        learner = StreamingLearner(trainer, engine, episodes, _config())  # never trains
        await episodes.watch(asyncio.ensure_future(learner.run(1)))

    with pytest.raises(RewardError, match="broken.*no scorer.*reward_on_error=skip"):
        asyncio.run(asyncio.wait_for(learner_stops(), timeout=120))


def test_too_many_dropped_groups_stop_the_run(model, engine):
    """Every group fails its reward (skip): past max_dropped_groups_per_step the learner stops
    with the reasons instead of drawing groups forever."""
    trainer = _trainer(model, RLAlgorithmConfig.grpo())
    for cls in (StreamingLearner, SyncLearner):
        learner = cls(trainer, engine, _episodes(Reward("broken", _broken), "skip"),
                      _config(max_dropped_groups_per_step=3))
        with pytest.raises(NoVarianceError, match=r"dropped [45] groups.*episode_failed x[45]"):
            asyncio.run(asyncio.wait_for(learner.run(1), timeout=120))
        assert learner.records == []


def test_a_dead_engine_stops_the_run_with_its_error(model):
    """Every episode fails when the engine is gone: after max_failed_groups_in_a_row groups in
    a row the learner stops, quoting the engine's error, instead of drawing groups forever."""
    with Engine(model, EngineConfig(max_slots=8, max_len=32, prefill_chunks=(8, 32))) as dead:
        pass  # started, then stopped: every request now raises EngineError
    trainer = _trainer(model, RLAlgorithmConfig.grpo())
    for cls in (StreamingLearner, SyncLearner):
        learner = cls(trainer, dead, _episodes(), _config(max_failed_groups_in_a_row=5))
        with pytest.raises(EpisodesFailingError,
                           match=r"last \d+ groups each had a failed episode.*=5\).*EngineError: the engine is stopped"):
            asyncio.run(asyncio.wait_for(learner.run(1), timeout=120))
        assert learner.records == [] and learner.queue.failed_in_a_row >= 5
    with pytest.raises(ValueError, match="max_failed_groups_in_a_row"):
        _config(max_failed_groups_in_a_row=0)


def test_an_episode_is_the_prompt_then_one_turn():
    episodes = _episodes()
    interaction = episodes(EpisodeSpec(group_id=0, index=1, episode_id=1, seed=0))
    first = next(ArithmeticTask(digits=2).iter_examples("train", 0))
    assert asyncio.run(interaction.start()) == TOKENIZER.encode(first.prompt)
    assert dataclasses.asdict(_config().orchestrator.agent)["max_turns"] == 1
