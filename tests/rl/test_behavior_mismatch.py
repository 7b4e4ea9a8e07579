"""The rollout-vs-trainer log-prob mismatch metrics (rl.policy_loss.behavior_mismatch), on
hand-computed inputs, and that every policy loss reports them."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from nonstop.rl.config import RLAlgorithmConfig
from nonstop.rl.policy_loss import behavior_mismatch, policy_loss

TRAINER = jnp.array([[-1.0, -2.0, -0.5, -3.0]])
BEHAVIOR = jnp.array([[-1.1, -1.5, -0.5, -9.0]])
MASK = jnp.array([[True, True, True, False]])  # the last token is not a sampled one


def test_gap_and_k3_by_hand():
    m = behavior_mismatch(TRAINER, BEHAVIOR, MASK)
    assert float(m["behavior_logprob_gap_mean"]) == pytest.approx((0.1 + 0.5 + 0.0) / 3)
    assert float(m["behavior_logprob_gap_max"]) == pytest.approx(0.5)  # not the masked 6.0
    # k3 = r - 1 - log r, r = pi_trainer / pi_behavior, per sampled token.
    k3 = [math.exp(d) - 1 - d for d in (0.1, -0.5, 0.0)]
    assert float(m["behavior_kl_k3"]) == pytest.approx(sum(k3) / 3, rel=1e-5)


def test_no_mismatch_is_zero():
    m = behavior_mismatch(TRAINER, TRAINER, MASK)
    assert all(float(v) == 0.0 for v in m.values())


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "gspo"])
def test_every_policy_loss_reports_them(algorithm: str):
    config = getattr(RLAlgorithmConfig, algorithm)().policy_loss
    out = policy_loss(
        TRAINER,
        advantages=jnp.ones_like(TRAINER),
        behavior_logprobs=BEHAVIOR,
        loss_mask=MASK,
        segment_ids=jnp.array([[1, 1, 1, 0]]),
        config=config,
        max_segments=2,
        ref_logprobs=TRAINER,
    )
    want = behavior_mismatch(TRAINER, BEHAVIOR, MASK)
    for name, value in want.items():
        np.testing.assert_allclose(float(out.metrics[name]), float(value), rtol=1e-6)
