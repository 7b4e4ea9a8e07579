"""KL divergence to a frozen reference policy, per token, as a loss term or a reward penalty.

With tokens sampled from pi (the policy) and log_ratio = log pi(y) - log pi_ref(y), the three
estimators of KL(pi || pi_ref) from Schulman's "Approximating KL Divergence" note are

- k1 = log_ratio                                  unbiased, high variance, can be negative;
- k2 = 0.5 * log_ratio ** 2                       biased, low variance, >= 0;
- k3 = exp(-log_ratio) + log_ratio - 1            unbiased, low variance, >= 0 (GRPO's choice).

Departure: log_ratio is clamped to [-20, 20] (as verl does) so that k3's exp never overflows on
a token the reference finds near-impossible. Tokens outside the loss mask get 0.
"""

from __future__ import annotations

from typing import get_args

import jax
import jax.numpy as jnp

from nonstop.rl.config import KLEstimator

LOG_RATIO_CLAMP = 20.0


def kl_estimate(
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    loss_mask: jax.Array,
    *,
    estimator: KLEstimator,
) -> jax.Array:
    """float32[B,T]: per-token estimate of KL(pi || pi_ref); differentiable in `logprobs`."""
    log_ratio = jnp.where(loss_mask, logprobs - ref_logprobs, 0.0).astype(jnp.float32)
    log_ratio = jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * jnp.square(log_ratio)
    elif estimator == "k3":
        kl = jnp.exp(-log_ratio) + log_ratio - 1.0
    else:
        raise ValueError(f"KL estimator {estimator!r} is not one of {get_args(KLEstimator)}")
    return jnp.where(loss_mask, kl, 0.0)


def kl_penalized_rewards(
    token_rewards: jax.Array,
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    loss_mask: jax.Array,
    *,
    coef: float,
    estimator: KLEstimator = "k1",
) -> jax.Array:
    """float32[B,T]: `token_rewards - coef * kl` on loss tokens (PPO's KL-in-reward).

    `logprobs` are those of the sampling policy (behaviour or old log-probs); the penalty is a
    reward, so no gradient flows through it. For an episode-level reward (RLOO), sum the penalty
    per sequence with `aggregation.segment_sum` instead.
    """
    kl = jax.lax.stop_gradient(kl_estimate(logprobs, ref_logprobs, loss_mask, estimator=estimator))
    return jnp.asarray(token_rewards, dtype=jnp.float32) - coef * kl
