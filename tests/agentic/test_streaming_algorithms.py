"""The agentic learners with the algorithms whose advantages do not come from the group queue
alone, on a real engine and PolicyTrainer (tiny Qwen3):

- PPO: the queue leaves advantages to the critic; streaming at max_staleness 0 takes exactly the
  synchronous steps, policy and critic alike;
- KL as a reward penalty for a group estimator (RLOO's default): each episode's advantage is
  recomputed from reward - coef * its summed KL to the reference, checked against the RLOO
  formula by hand, and streaming at max_staleness 0 again equals the synchronous learner.
"""

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
from nonstop.agentic.streaming import StreamingLearner, SyncLearner
from nonstop.agentic.trajectory_builder import ScriptedToolInteraction
from nonstop.engine import Engine, EngineConfig, SamplingParams
from nonstop.models import ModelConfig, init_decoder
from nonstop.rl import OffPolicyConfig, RLAlgorithmConfig
from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
from nonstop.train import OptimizerConfig, PackingConfig

G, B, TURN, STEPS = 3, 2, 8, 3


def _tis(algorithm: RLAlgorithmConfig) -> RLAlgorithmConfig:
    loss = dataclasses.replace(algorithm.policy_loss,
                               off_policy=OffPolicyConfig(correction="tis", weight_cap=2.0))
    return dataclasses.replace(algorithm, policy_loss=loss)


@pytest.fixture(scope="module")
def engine_and_model():
    model = init_decoder(ModelConfig.tiny("qwen3"), seed=3)
    params = jax.tree.map(jnp.copy, nnx.state(model))
    with Engine(model, EngineConfig(max_slots=8, max_len=64, prefill_chunks=(8, 32))) as engine:
        yield engine, model, params


def _trainer(model, algorithm: RLAlgorithmConfig) -> PolicyTrainer:
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    return PolicyTrainer(copy, PolicyTrainerConfig(
        algorithm=_tis(algorithm),
        optimizer=OptimizerConfig(learning_rate=3e-3, schedule="constant", weight_decay=0.0),
        packing=PackingConfig(buckets=(64,), rows_per_batch=B * G, max_segments_per_row=4)))


def _reset(engine, params, trainer: PolicyTrainer, initial) -> None:
    trainer.state = jax.tree.map(jnp.copy, initial[0])
    if trainer.critic is not None:
        trainer.critic.state = jax.tree.map(jnp.copy, initial[1])
    trainer.steps_taken = 0
    engine.update_weights(params, version=0)
    engine.generate_sync([1, 2], SamplingParams(max_tokens=1))  # the update is applied first
    assert engine.policy_version == 0


def make_interaction(spec: EpisodeSpec) -> ScriptedToolInteraction:
    async def tool(turn, sampled):
        await asyncio.sleep(0.01 * ((spec.episode_id * 7 + turn) % 5))
        return [3, 4, 5, 6]

    turns = 1 + (spec.group_id * 5 + spec.index * 3) % 3
    return ScriptedToolInteraction([40 + spec.group_id % 50, 31, 32, 33, 34, 35, 36, 37],
                                   num_turns=turns, tool=tool,
                                   reward_fn=lambda answer: float(np.mean(answer)) / 256)


def _config() -> StreamingLearnerConfig:
    agent = AgentConfig(max_turns=3, max_tokens_per_turn=TURN, ignore_eos=True)
    return StreamingLearnerConfig(groups_per_step=B, max_staleness=0, sync_every=1,
                         orchestrator=OrchestratorConfig(group_size=G, max_concurrency=8,
                                                         seed=11, agent=agent))


def _both_learners(engine, params, trainer, initial, spy=None):
    """(records, policy params, critic params or None) of the sync then the streaming learner."""
    out = []
    for cls in (SyncLearner, StreamingLearner):
        _reset(engine, params, trainer, initial)
        if spy is not None:
            spy.clear()
        records = asyncio.run(cls(trainer, engine, make_interaction, _config()).run(STEPS))
        critic = (None if trainer.critic is None
                  else jax.tree.map(np.asarray, trainer.critic.state.params))
        out.append((records, jax.tree.map(np.asarray, trainer.state.params), critic,
                    list(spy or ())))
    return out


def _assert_same(a, b, initial_params):
    (ra, pa, ca, _), (rb, pb, cb, _) = a, b
    for x, y in zip(ra, rb, strict=True):
        assert x.group_ids == y.group_ids and x.metrics["loss"] == y.metrics["loss"]
        assert x.reward_mean == y.reward_mean and set(y.staleness) == {0}
    leaves_a, leaves_b = jax.tree.leaves(pa), jax.tree.leaves(pb)
    assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))
    assert not np.array_equal(leaves_a[0], jax.tree.leaves(initial_params)[0])  # it trained
    if ca is not None:
        assert all(np.array_equal(x, y) for x, y in
                   zip(jax.tree.leaves(ca), jax.tree.leaves(cb), strict=True))


def test_ppo_streams_with_its_critic_and_matches_the_synchronous_learner(engine_and_model):
    engine, model, params = engine_and_model
    trainer = _trainer(model, RLAlgorithmConfig.ppo())
    assert trainer.uses_gae and trainer.kl_in_reward  # PPO's per-token KL penalty
    initial = (jax.tree.map(jnp.copy, trainer.state), jax.tree.map(jnp.copy, trainer.critic.state))
    seen: list = []
    train = trainer.train
    trainer.train = lambda ts: seen.append(list(ts)) or train(ts)  # records what it trained on
    sync, streaming = _both_learners(engine, params, trainer, initial, seen)
    _assert_same(sync, streaming, initial[0].params)
    critic_before = jax.tree.leaves(initial[1].params)
    assert any(not np.array_equal(x, y) for x, y in
               zip(jax.tree.leaves(streaming[2]), critic_before, strict=True))  # critic trained
    for r in streaming[0]:
        assert np.isfinite(r.metrics["value_loss"]) and "reward_kl" in r.metrics
    # The queue set no group advantages: PPO's come from the critic in the trainer.
    assert all(t.advantage == 0.0 for step in streaming[3] for t in step)


def test_kl_as_a_reward_penalty_recomputes_group_advantages(engine_and_model):
    engine, model, params = engine_and_model
    algorithm = RLAlgorithmConfig.rloo()
    coef = algorithm.policy_loss.kl.coef
    assert algorithm.kl.mode == "reward" and coef > 0
    trainer = _trainer(model, algorithm)
    initial = (jax.tree.map(jnp.copy, trainer.state), None)
    seen: list = []
    train = trainer.train
    trainer.train = lambda ts: seen.append(list(ts)) or train(ts)
    sync, streaming = _both_learners(engine, params, trainer, initial, seen)
    _assert_same(sync, streaming, initial[0].params)
    steps = streaming[3]
    assert len(steps) == STEPS
    # The reference is the initial model and behaviour log-probs are stored: each episode's KL
    # can be summed again after training, and must be what was taken off its reward.
    penalties = []
    for record, step in zip(streaming[0], steps, strict=True):
        kl = trainer.sequence_kl(step)
        np.testing.assert_allclose([t.info["kl_penalty"] for t in step], coef * kl,
                                   rtol=1e-5, atol=1e-7)
        assert record.metrics["kl_penalty"] == pytest.approx(float(np.mean(coef * kl)),
                                                             rel=1e-5, abs=1e-9)
        for g in range(B):
            group = step[g * G:(g + 1) * G]
            assert len({t.group_id for t in group}) == 1
            values = np.array([t.reward for t in group]) - coef * kl[g * G:(g + 1) * G]
            expected = G / (G - 1) * (values - values.mean())  # RLOO, by hand
            np.testing.assert_allclose([t.advantage for t in group], expected,
                                       rtol=1e-4, atol=1e-6)
        penalties.append(coef * kl)
    # After the first update the behaviour policy has left the reference: a real penalty that
    # moves the advantages away from the raw rewards' ones.
    assert np.abs(penalties[-1]).max() > 1e-4
    last = steps[-1][:G]
    raw = np.array([t.reward for t in last])
    assert not np.allclose([t.advantage for t in last], G / (G - 1) * (raw - raw.mean()),
                           atol=1e-6)
