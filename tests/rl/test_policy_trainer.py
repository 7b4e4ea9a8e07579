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
