"""PolicyTrainer wiring: packing trajectories, old/reference log-probs, steps that follow the sign
of the advantage."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from nonstop.models import ModelConfig, init_decoder
from nonstop.rl import KLConfig, RLAlgorithmConfig
from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
from nonstop.rl.trajectory import Trajectory
from nonstop.train import OptimizerConfig, PackingConfig, token_logprobs

CFG = ModelConfig.tiny("qwen3", vocab_size=31)


def _episodes(good_adv: float) -> list[Trajectory]:
    prompt = [1, 5, 6]
    good, bad = [7, 8, 9], [10, 11, 12]
    out = []
    for i, (completion, adv) in enumerate([(good, good_adv), (bad, -good_adv)] * 2):
        t = Trajectory.from_completion(prompt, completion, [-1.0] * 3, [0] * 3, group_id=0,
                                       episode_id=i)
        t.advantage = adv
        out.append(t)
    return out


def _seq_logprob(model, tokens) -> float:
    logits, _ = model(jnp.asarray([tokens]))
    return float(token_logprobs(logits, jnp.asarray([tokens]))[0, 3:].sum())


@pytest.mark.parametrize("algorithm,epochs", [
    (RLAlgorithmConfig.grpo(), 1),
    (RLAlgorithmConfig.dapo(), 2),
    (RLAlgorithmConfig.gspo(), 1),
])
def test_steps_move_probability_toward_positive_advantage(algorithm, epochs):
    cfg = PolicyTrainerConfig(
        algorithm=algorithm, inner_epochs=epochs,
        optimizer=OptimizerConfig(learning_rate=3e-3, schedule="constant", weight_decay=0.0),
        packing=PackingConfig(buckets=(16,), rows_per_batch=2, max_segments_per_row=4))
    trainer = PolicyTrainer(init_decoder(CFG, seed=0), cfg)
    good, bad = [1, 5, 6, 7, 8, 9], [1, 5, 6, 10, 11, 12]
    before = _seq_logprob(trainer.model(), good) - _seq_logprob(trainer.model(), bad)
    for _ in range(3):
        metrics = trainer.train(_episodes(1.0))
    after = _seq_logprob(trainer.model(), good) - _seq_logprob(trainer.model(), bad)
    assert after > before + 0.1
    assert metrics["optimizer_steps"] == epochs  # 4 episodes of 6 tokens fit one 2x16 batch
    assert trainer.needs_old == (epochs > 1)
    assert np.isfinite(metrics["loss"])


def test_reference_is_the_initial_policy():
    algorithm = dataclasses.replace(RLAlgorithmConfig.grpo())
    assert algorithm.kl.coef > 0
    cfg = PolicyTrainerConfig(algorithm=algorithm, optimizer=OptimizerConfig(
        learning_rate=1e-2, schedule="constant"),
        packing=PackingConfig(buckets=(16,), rows_per_batch=2, max_segments_per_row=4))
    trainer = PolicyTrainer(init_decoder(CFG, seed=0), cfg)
    first = trainer._with_logprobs(trainer.pack(_episodes(1.0))[0])
    trainer.train(_episodes(1.0))
    again = trainer._with_logprobs(trainer.pack(_episodes(1.0))[0])
    np.testing.assert_allclose(np.asarray(again.ref_logprobs), np.asarray(first.ref_logprobs),
                               atol=1e-6)
    assert KLConfig().coef >= 0


def test_missing_advantage_is_named():
    trainer = PolicyTrainer(init_decoder(CFG), PolicyTrainerConfig(
        packing=PackingConfig(buckets=(16,), rows_per_batch=2, max_segments_per_row=4)))
    t = Trajectory.from_completion([1, 2], [3], [-0.5], [0], group_id=0, episode_id=7)
    with pytest.raises(ValueError, match="episode 7 has no advantage"):
        trainer.train([t])


def _ppo_trainer(kl_coef: float, whiten: bool = False) -> PolicyTrainer:
    ppo = RLAlgorithmConfig.ppo()
    algorithm = dataclasses.replace(
        ppo, advantage=dataclasses.replace(ppo.advantage, whiten=whiten),
        policy_loss=dataclasses.replace(
            ppo.policy_loss, kl=dataclasses.replace(ppo.kl, coef=kl_coef)))
    return PolicyTrainer(init_decoder(CFG, seed=0), PolicyTrainerConfig(
        algorithm=algorithm,
        optimizer=OptimizerConfig(learning_rate=3e-3, schedule="constant", weight_decay=0.0),
        packing=PackingConfig(buckets=(16,), rows_per_batch=2, max_segments_per_row=4)))


def _scored(rewards: list[float]) -> list[Trajectory]:
    episodes = _episodes(1.0)
    for t, r in zip(episodes, rewards, strict=True):
        t.advantage, t.reward = None, r
    return episodes


def test_value_model_reads_the_hidden_state_before_each_token():
    trainer = _ppo_trainer(0.0)
    critic = trainer.critic
    head = np.linspace(-1.0, 1.0, CFG.hidden_size).astype(np.float32)
    model = critic.state.model()
    model.head[...] = jnp.asarray(head)
    tokens = jnp.asarray([[1, 5, 6, 7, 8]])
    positions = jnp.arange(5)[None]
    values = np.asarray(model(tokens, positions, jnp.ones_like(tokens)))
    h, _ = model.backbone.hidden_states(model.backbone.embed_tokens(tokens), positions,
                                        jnp.ones_like(tokens), None, None)
    expected = np.asarray(h[0]) @ head
    assert values[0, 0] == 0.0
    np.testing.assert_allclose(values[0, 1:], expected[:-1], rtol=1e-5, atol=1e-5)


def test_gae_advantages_on_packed_episodes():
    # The critic's head starts at 0, so V = 0 and, with gamma = 1, lam = 0.95, an episode with
    # reward R on its last of 3 sampled tokens gets advantages [lam^2 R, lam R, R].
    trainer = _ppo_trainer(0.0)
    packed = trainer.pack(_scored([1.0, 0.0, 1.0, 0.0]))
    batches = [trainer._with_logprobs(p) for p in packed]
    out, value_batches, stats = trainer._gae_advantages(_scored([1.0, 0.0, 1.0, 0.0]), packed,
                                                        batches)
    per_episode = packed[0].gather(np.asarray(out[0].advantages))
    lam = 0.95
    for got, reward in zip(per_episode, [1.0, 0.0, 1.0, 0.0], strict=True):
        np.testing.assert_allclose(got, [0, 0, 0, lam**2 * reward, lam * reward, reward],
                                   rtol=1e-6)
    np.testing.assert_allclose(np.asarray(value_batches[0].returns), np.asarray(out[0].advantages))
    assert stats["advantage_mean_raw"] == pytest.approx(2 * (lam**2 + lam + 1) / 12, rel=1e-6)


def test_kl_reward_penalty_uses_behaviour_minus_reference():
    # k1: kl_t = behaviour - reference log-prob of each sampled token, summed per episode.
    trainer = _ppo_trainer(0.5)
    episodes = _scored([1.0, 0.0, 1.0, 0.0])
    model = trainer.model()
    expected = [-3.0 - _seq_logprob(model, list(t.tokens)) for t in episodes]
    np.testing.assert_allclose(trainer.sequence_kl(episodes), expected, rtol=1e-5)
    packed = trainer.pack(episodes)
    batches = [trainer._with_logprobs(p) for p in packed]
    out, _, stats = trainer._gae_advantages(episodes, packed, batches)
    assert stats["reward_kl"] == pytest.approx(np.mean(expected) / 3, rel=1e-5)
    # The last sampled token's advantage (V = 0) is its reward minus 0.5 * its own KL.
    ref = np.asarray(batches[0].ref_logprobs)
    for t, place, adv in zip(episodes, packed[0].placements,
                             packed[0].gather(np.asarray(out[0].advantages)), strict=True):
        last_kl = -1.0 - ref[place.row, place.start + place.length - 1]
        assert adv[-1] == pytest.approx(t.reward - 0.5 * last_kl, rel=1e-5)


def test_ppo_critic_fits_the_returns():
    trainer = _ppo_trainer(0.0, whiten=True)
    errors = [trainer.train(_scored([1.0, 0.0, 1.0, 0.0]))["value_mse"] for _ in range(8)]
    assert errors[-1] < 0.5 * errors[0], errors
