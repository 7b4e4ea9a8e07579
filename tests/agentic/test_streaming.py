"""Streaming and synchronous learners on a real engine and PolicyTrainer (tiny Qwen3): at
max_staleness 0 streaming takes exactly the synchronous steps; at max_staleness 1 every trained
episode is within the bound; and the admission/deadline arithmetic on hand-worked cases."""

from __future__ import annotations

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nonstop.agentic.config import AgentConfig, OrchestratorConfig, StreamingLearnerConfig
from nonstop.agentic.orchestrator import EpisodeSpec
from nonstop.agentic.streaming import NoSamplesError, StalenessGate, StreamingLearner, SyncLearner
from nonstop.agentic.trajectory_builder import ScriptedToolInteraction
from nonstop.engine import Engine, EngineConfig, SamplingParams
from nonstop.models import ModelConfig, init_decoder
from nonstop.rl import KLConfig, OffPolicyConfig, RLAlgorithmConfig
from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
from nonstop.train import OptimizerConfig, PackingConfig

G, B, TURN = 3, 2, 8


def _algorithm(dynamic_sampling: bool) -> RLAlgorithmConfig:
    base = RLAlgorithmConfig.grpo()
    loss = dataclasses.replace(base.policy_loss, kl=KLConfig(coef=0.0),
                               off_policy=OffPolicyConfig(correction="tis", weight_cap=2.0))
    return dataclasses.replace(base, policy_loss=loss, dynamic_sampling=dynamic_sampling)


@pytest.fixture(scope="module")
def setup():
    model = init_decoder(ModelConfig.tiny("qwen3"), seed=2)
    graphdef, state = nnx.split(model)
    trainer_model = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    cfg = PolicyTrainerConfig(
        algorithm=_algorithm(dynamic_sampling=True),
        optimizer=OptimizerConfig(learning_rate=3e-3, schedule="constant", weight_decay=0.0),
        packing=PackingConfig(buckets=(64,), rows_per_batch=B * G, max_segments_per_row=4))
    trainer = PolicyTrainer(trainer_model, cfg)
    initial = jax.tree.map(jnp.copy, trainer.state), jax.tree.map(jnp.copy, nnx.state(model))
    with Engine(model, EngineConfig(max_slots=8, max_len=64, prefill_chunks=(8, 32))) as engine:
        yield trainer, engine, initial


def _reset(setup, *, dynamic_sampling=True):
    """Trainer and engine back at the initial weights, version 0 (one compiled step for all)."""
    trainer, engine, (state, params) = setup
    trainer.state = jax.tree.map(jnp.copy, state)
    trainer.steps_taken = 0
    trainer.algorithm = _algorithm(dynamic_sampling)
    engine.update_weights(params, version=0)
    engine.generate_sync([1, 2], SamplingParams(max_tokens=1))  # the update is applied first
    assert engine.policy_version == 0
    return trainer, engine


def make_interaction(spec: EpisodeSpec) -> ScriptedToolInteraction:
    """Heavy-ish tails: 1-4 turns; tool latencies 0-40 ms scramble the completion order."""

    async def tool(turn, sampled):
        await asyncio.sleep(0.01 * ((spec.episode_id * 7 + turn) % 5))
        return [3, 4, 5, 6]

    turns = 1 + (spec.group_id * 5 + spec.index * 3) % 4
    return ScriptedToolInteraction([30 + spec.group_id % 50, 31, 32, 33, 34, 35, 36, 37],
                                   num_turns=turns, tool=tool,
                                   reward_fn=lambda answer: float(np.mean(answer) < 128))


def _config(max_staleness: int) -> StreamingLearnerConfig:
    agent = AgentConfig(max_turns=4, max_tokens_per_turn=TURN, ignore_eos=True)
    return StreamingLearnerConfig(groups_per_step=B, max_staleness=max_staleness, sync_every=1,
                         orchestrator=OrchestratorConfig(group_size=G, max_concurrency=8,
                                                         seed=7, agent=agent))


def test_streaming_at_staleness_0_takes_exactly_the_synchronous_steps(setup):
    steps = 3
    trainer, engine = _reset(setup)
    sync = SyncLearner(trainer, engine, make_interaction, _config(0))
    sync_records = asyncio.run(sync.run(steps))
    sync_params = jax.tree.map(np.asarray, trainer.state.params)
    sync_dropped = dict(sync.queue.dropped)

    trainer, engine = _reset(setup)
    streaming = StreamingLearner(trainer, engine, make_interaction, _config(0))
    stream_records = asyncio.run(streaming.run(steps))
    stream_params = jax.tree.map(np.asarray, trainer.state.params)

    assert sum(sync_dropped.values()) >= 1  # dynamic sampling replaced some groups: same ids
    for a, b in zip(sync_records, stream_records, strict=True):
        assert a.group_ids == b.group_ids and a.version == b.version
        assert a.metrics["loss"] == b.metrics["loss"]  # bit for bit
        assert a.reward_mean == b.reward_mean and set(b.staleness) == {0}
    leaves_a, leaves_b = jax.tree.leaves(sync_params), jax.tree.leaves(stream_params)
    assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))
    assert not np.array_equal(leaves_a[0], jax.tree.leaves(setup[2][0].params)[0])  # it trained
    assert [r.published for r in stream_records] == list(range(1, steps + 1))


def test_staleness_never_exceeds_the_bound(setup):
    trainer, engine = _reset(setup, dynamic_sampling=False)
    learner = StreamingLearner(trainer, engine, make_interaction, _config(1))
    records = asyncio.run(learner.run(6))
    staleness = [s for r in records for s in r.staleness]
    assert len(staleness) == 6 * B * G
    assert max(staleness) == 1  # the bound is reached (the second step's groups started at 0)
    assert [r.version for r in records] == list(range(6))
    assert all(np.isfinite(r.metrics["loss"]) for r in records)
    # Admission: never more than (max_staleness + 1) * B groups ahead of the trainer.
    assert learner.orchestrator.started <= (6 + 1 + 1) * B * G
    assert [r.published for r in records] == list(range(1, 7))


def test_admission_and_deadlines_by_hand():
    async def main():
        gate = StalenessGate(groups_per_step=2, max_staleness=1, version=0)
        for g in range(4):  # (0 + 1 + 1 - 0) x 2 = 4 groups may start at version 0
            await gate.admit(g)
        assert not gate.admissible() and gate.deadlines == {0: 1, 1: 1, 2: 1, 3: 1}
        # Step 0 may take any two of them (the other two then make step 1's deadline).
        assert gate.need() == 2 and gate.can_take(3, [], 2) and gate.can_take(2, [3], 1)
        gate.trained([3, 2])
        assert gate.need() == 2 and not gate.admissible()  # step 1 must take 0 and 1
        gate.published(1)
        await gate.admit(4)
        await gate.admit(5)  # (1 + 1 + 1 - 1) x 2 = 4 outstanding
        assert gate.deadlines == {0: 1, 1: 1, 4: 2, 5: 2} and not gate.admissible()
        # Group 4 finished first, but taking it would leave 0 or 1 past its deadline.
        assert not gate.can_take(4, [], 2) and gate.can_take(1, [], 2)
        assert not gate.can_take(4, [1], 1) and gate.can_take(0, [1], 1)
        gate.release(5)  # dropped by the queue: its place is free again
        assert gate.admissible()

    asyncio.run(main())


def test_a_step_whose_episodes_sampled_nothing_stops_with_the_cause(setup):
    """Prompts that fill the engine's 64-position context: every episode ends context_full
    before sampling; the learner stops at its first step and says why, instead of training on
    nothing."""
    trainer, engine = _reset(setup, dynamic_sampling=False)

    def too_long(spec: EpisodeSpec) -> ScriptedToolInteraction:
        async def no_tool(turn, sampled):
            return []

        return ScriptedToolInteraction(list(range(10, 74)), num_turns=1, tool=no_tool,
                                       reward_fn=lambda answer: 0.0)

    learner = StreamingLearner(trainer, engine, too_long, _config(0))
    with pytest.raises(NoSamplesError, match=r"step 0: none of its 6 episodes sampled a token "
                                             r"\(outcomes: context_full x6; prompts of 64-64 "
                                             r"tokens\).*raise engine\.max_len"):
        asyncio.run(asyncio.wait_for(learner.run(2), timeout=120))
    assert learner.records == []
