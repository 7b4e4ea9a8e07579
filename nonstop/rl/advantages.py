"""Episode-level advantages from grouped rewards, DAPO's reward pieces, and moving them to tokens.

Group-relative estimators over the G episodes that share a prompt (a group):

- `grpo` (Shao et al. 2024): (r - mean) / (std + eps), std with Bessel's correction as in TRL
  and verl (a group of one has std 0).
- `dr_grpo` (Liu et al. 2025): r - mean, no std normalisation.
- `rloo` (Ahmadian et al. 2024): r - mean of the *other* episodes = G / (G - 1) * (r - mean);
  0 for a group of one.

A group whose rewards are all equal gets exactly 0 advantages (not eps-scaled rounding noise),
and `group_has_variance` is DAPO's dynamic-sampling filter. GAE (PPO) works per token with a
value model and lives in `value_loss.py`.

`broadcast_to_tokens` and `episode_rewards_to_token_rewards` place per-episode values onto a
packed `TrainBatch` given `episode_index[b, s-1]`: the episode held by segment s of row b (-1 for
an unused segment).
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp

from nonstop.rl.aggregation import segment_max, segments_to_tokens
from nonstop.rl.config import OverlongConfig

GroupEstimator = Literal["grpo", "dr_grpo", "rloo"]


def episode_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    *,
    num_groups: int,
    estimator: GroupEstimator = "grpo",
    std_eps: float = 1e-6,
) -> jax.Array:
    """float32[E]: group-relative advantage of each episode.

    `rewards` float32[E]; `group_ids` int32[E] in [0, num_groups) (static `num_groups`); groups may
    have different sizes, and a group id with no episodes is simply unused.
    """
    if estimator not in get_args(GroupEstimator):
        raise ValueError(f"estimator {estimator!r} is not one of {get_args(GroupEstimator)}")
    rewards = jnp.asarray(rewards, dtype=jnp.float32)
    group_ids = jnp.asarray(group_ids, dtype=jnp.int32)

    def per_group_sum(values: jax.Array) -> jax.Array:
        return jax.ops.segment_sum(values, group_ids, num_segments=num_groups)[group_ids]

    count = per_group_sum(jnp.ones_like(rewards))
    deviation = rewards - per_group_sum(rewards) / count
    has_variance = episode_group_has_variance(rewards, group_ids, num_groups=num_groups)

    if estimator == "grpo":
        variance = per_group_sum(deviation**2) / jnp.maximum(count - 1.0, 1.0)
        advantages = deviation / (jnp.sqrt(variance) + std_eps)
    elif estimator == "dr_grpo":
        advantages = deviation
    else:  # rloo
        advantages = deviation * count / jnp.maximum(count - 1.0, 1.0)
    return jnp.where(has_variance, advantages, 0.0)


def group_advantages(
    rewards: jax.Array, *, estimator: GroupEstimator = "grpo", std_eps: float = 1e-6
) -> jax.Array:
    """float32[G_count, G]: `episode_advantages` for rewards already laid out one group per row."""
    num_groups, group_size = rewards.shape
    group_ids = jnp.repeat(jnp.arange(num_groups, dtype=jnp.int32), group_size)
    flat = episode_advantages(
        jnp.reshape(rewards, -1),
        group_ids,
        num_groups=num_groups,
        estimator=estimator,
        std_eps=std_eps,
    )
    return flat.reshape(num_groups, group_size)


def episode_group_has_variance(
    rewards: jax.Array, group_ids: jax.Array, *, num_groups: int
) -> jax.Array:
    """bool[E]: whether the episode's group has at least two distinct rewards."""
    rewards = jnp.asarray(rewards, dtype=jnp.float32)
    group_ids = jnp.asarray(group_ids, dtype=jnp.int32)
    highest = jax.ops.segment_max(rewards, group_ids, num_segments=num_groups)
    lowest = jax.ops.segment_min(rewards, group_ids, num_segments=num_groups)
    return (highest > lowest)[group_ids]


def group_has_variance(rewards: jax.Array) -> jax.Array:
    """bool[G_count]: DAPO's dynamic-sampling filter over rewards [G_count, G]; keep rows that
    are True. A group whose rewards are all equal has zero advantages and so no gradient."""
    rewards = jnp.asarray(rewards, dtype=jnp.float32)
    return jnp.max(rewards, axis=1) > jnp.min(rewards, axis=1)


def overlong_penalty(response_lengths: jax.Array, config: OverlongConfig) -> jax.Array:
    """float32[E]: DAPO's soft overlong punishment, added to each episode's reward.

    0 up to `max_response_tokens - buffer_tokens` tokens, then linear down to `-penalty` at
    `max_response_tokens`, and `-penalty` beyond.
    """
    lengths = jnp.asarray(response_lengths, dtype=jnp.float32)
    start = float(config.max_response_tokens - config.buffer_tokens)
    excess = jnp.clip((lengths - start) / float(config.buffer_tokens), 0.0, 1.0)
    return -config.penalty * excess


def _episodes_to_segments(episode_values: jax.Array, episode_index: jax.Array) -> jax.Array:
    """[B,M]: `episode_values[episode_index]`, 0 where the index is -1."""
    index = jnp.asarray(episode_index, dtype=jnp.int32)
    gathered = jnp.asarray(episode_values, dtype=jnp.float32)[jnp.maximum(index, 0)]
    return jnp.where(index >= 0, gathered, 0.0)


def broadcast_to_tokens(
    episode_values: jax.Array,
    episode_index: jax.Array,
    segment_ids: jax.Array,
    loss_mask: jax.Array,
) -> jax.Array:
    """float32[B,T]: each loss token gets its episode's value (e.g. its advantage), others 0.

    `episode_values` float32[E]; `episode_index` int32[B,M], -1 for an unused segment.
    """
    per_segment = _episodes_to_segments(episode_values, episode_index)
    return jnp.where(loss_mask, segments_to_tokens(per_segment, segment_ids), 0.0)


def episode_rewards_to_token_rewards(
    episode_rewards: jax.Array,
    episode_index: jax.Array,
    segment_ids: jax.Array,
    loss_mask: jax.Array,
) -> jax.Array:
    """float32[B,T]: each episode's reward on the last loss token of its segment, 0 elsewhere.

    The per-token rewards that GAE and the KL reward penalty work on.
    """
    max_segments = episode_index.shape[1]
    positions = jnp.broadcast_to(
        jnp.arange(segment_ids.shape[1], dtype=jnp.int32), segment_ids.shape
    )
    loss_positions = jnp.where(loss_mask, positions, -1)
    last = segments_to_tokens(segment_max(loss_positions, segment_ids, max_segments), segment_ids)
    is_last = loss_mask & (positions == last)
    per_segment = _episodes_to_segments(episode_rewards, episode_index)
    return jnp.where(is_last, segments_to_tokens(per_segment, segment_ids), 0.0)
