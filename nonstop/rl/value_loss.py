"""PPO's critic side: GAE over packed rows, the clipped value loss, and the entropy bonus.

GAE (Schulman et al. 2016) runs right to left over each row with `jax.lax.scan`:

    delta_t = r_t + gamma * V_next - V_t,    A_t = delta_t + gamma * lam * A_next

where "next" is the next *loss* token of the same segment (0 past the segment's end: every
sequence ends its episode). Tokens outside the loss mask — prompt, tool observations, padding —
are not actions: they pass V_next and A_next through unchanged and get advantage 0, so a
multi-turn episode discounts once per sampled token, not per observation token (verl's multi-turn
convention). Rewards must therefore sit on loss tokens; `advantages.episode_rewards_to_token_
rewards` puts each episode's reward on its last one. Departure: truncated episodes are treated as
terminal (no bootstrap from a value past the row).

The value loss is 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2) per token,
aggregated like the policy loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nonstop.rl.aggregation import LossTerms, aggregate, masked_mean
from nonstop.rl.config import AggregationMode


def gae(
    token_rewards: jax.Array,
    values: jax.Array,
    loss_mask: jax.Array,
    segment_ids: jax.Array,
    *,
    gamma: float,
    lam: float,
) -> tuple[jax.Array, jax.Array]:
    """(advantages, returns), float32[B,T] each, 0 off the loss mask; returns = A + V.

    `token_rewards`, `values`: float32[B,T] (values from the critic that scored the rollout).
    """
    rewards = jnp.asarray(token_rewards, dtype=jnp.float32)
    values = jax.lax.stop_gradient(jnp.asarray(values, dtype=jnp.float32))
    loss_mask = jnp.asarray(loss_mask, dtype=bool)
    segment_ids = jnp.asarray(segment_ids, dtype=jnp.int32)
    batch, _ = rewards.shape

    def step(
        carry: tuple[jax.Array, jax.Array, jax.Array],
        token: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
        next_value, next_advantage, next_segment = carry
        reward, value, mask, segment = token
        same_segment = segment == next_segment
        next_value = jnp.where(same_segment, next_value, 0.0)
        next_advantage = jnp.where(same_segment, next_advantage, 0.0)
        delta = reward + gamma * next_value - value
        advantage = delta + gamma * lam * next_advantage
        carry = (
            jnp.where(mask, value, next_value),
            jnp.where(mask, advantage, next_advantage),
            segment,
        )
        return carry, jnp.where(mask, advantage, 0.0)

    init = (
        jnp.zeros((batch,), jnp.float32),
        jnp.zeros((batch,), jnp.float32),
        jnp.full((batch,), -1, jnp.int32),
    )
    tokens_first = (rewards.T, values.T, loss_mask.T, segment_ids.T)  # scan over T
    _, advantages = jax.lax.scan(step, init, tokens_first, reverse=True)
    advantages = advantages.T
    returns = jnp.where(loss_mask, advantages + values, 0.0)
    return advantages, returns


def masked_whiten(values: jax.Array, loss_mask: jax.Array, eps: float = 1e-8) -> jax.Array:
    """float32[B,T]: (x - mean) / sqrt(var + eps) over the loss tokens, 0 elsewhere.

    Whiten GAE advantages over the whole step's batch, before splitting into micro-batches.
    """
    mean = masked_mean(values, loss_mask)
    variance = masked_mean(jnp.square(values - mean), loss_mask)
    return jnp.where(loss_mask, (values - mean) * jax.lax.rsqrt(variance + eps), 0.0)


def value_loss(
    values: jax.Array,
    *,
    old_values: jax.Array,
    returns: jax.Array,
    loss_mask: jax.Array,
    segment_ids: jax.Array,
    clip_eps: float | None,
    mode: AggregationMode = "token_mean",
    max_segments: int,
    max_len_norm: int | None = None,
    denominator: jax.Array | None = None,
) -> LossTerms:
    """PPO's (clipped) value loss over a packed batch; arrays float32[B,T].

    `values` are the critic's current predictions (differentiated); `old_values` those at
    rollout time. Multiply by `ValueLossConfig.coef` when adding to the actor loss.
    """
    loss_mask = jnp.asarray(loss_mask, dtype=bool)
    values = values.astype(jnp.float32)
    errors = jnp.square(values - returns)
    if clip_eps is not None:
        clipped_values = old_values + jnp.clip(values - old_values, -clip_eps, clip_eps)
        errors = jnp.maximum(errors, jnp.square(clipped_values - returns))
    return aggregate(
        0.5 * errors,
        loss_mask,
        segment_ids,
        mode=mode,
        max_segments=max_segments,
        max_len_norm=max_len_norm,
        denominator=denominator,
    )


def token_entropy(logits: jax.Array) -> jax.Array:
    """float32[B,T]: entropy of softmax(logits) [B,T,V] at each position, in nats.

    Vocabulary entries with -inf logits (probability 0) contribute 0, without NaN gradients.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    probs = jnp.exp(log_probs)
    safe_log_probs = jnp.where(probs > 0, log_probs, 0.0)
    return -jnp.sum(probs * safe_log_probs, axis=-1)


def entropy(logits: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """float32[]: mean entropy over the loss tokens (0 if there are none).

    `logits[b, t]` must be the distribution that produced token t. For an exactly accumulated
    entropy *bonus*, aggregate `token_entropy` with `aggregation.aggregate` instead.
    """
    return masked_mean(token_entropy(logits), jnp.asarray(loss_mask, dtype=bool))
