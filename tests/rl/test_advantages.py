"""Group-relative advantages, DAPO's filter and overlong penalty, and placement onto tokens."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nonstop.rl import (
    OverlongConfig,
    broadcast_to_tokens,
    episode_advantages,
    episode_group_has_variance,
    episode_rewards_to_token_rewards,
    group_advantages,
    group_has_variance,
    overlong_penalty,
)

# Three groups of three: [1, 2, 3] has mean 2, deviations [-1, 0, 1] and Bessel std
# sqrt((1 + 0 + 1) / 2) = 1; [5, 5, 5] and [0.1, 0.1, 0.1] have no variance (0.1 is not exact in
# float32, so a mean-then-divide would leave rounding noise divided by eps).
GROUPED = np.array([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0], [0.1, 0.1, 0.1]], np.float32)


def test_grpo_normalises_by_group_mean_and_std() -> None:
    got = group_advantages(GROUPED, estimator="grpo", std_eps=1e-6)
    # [-1, 0, 1] / (1 + 1e-6); the equal-reward groups give exact zeros.
    want = np.array([[-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)], [0, 0, 0], [0, 0, 0]], np.float32)
    np.testing.assert_allclose(got, want, atol=1e-7)
    assert np.all(np.asarray(got[1:]) == 0.0)


def test_dr_grpo_only_subtracts_the_mean() -> None:
    got = group_advantages(GROUPED * 2.0, estimator="dr_grpo")
    # [2, 4, 6] - 4 = [-2, 0, 2]: no division by std.
    np.testing.assert_allclose(got[0], [-2.0, 0.0, 2.0], atol=1e-6)
    assert np.all(np.asarray(got[1:]) == 0.0)


def test_rloo_subtracts_the_mean_of_the_others() -> None:
    got = group_advantages(GROUPED, estimator="rloo")
    # 1 - (2 + 3) / 2 = -1.5;  2 - (1 + 3) / 2 = 0;  3 - (1 + 2) / 2 = 1.5.
    np.testing.assert_allclose(got[0], [-1.5, 0.0, 1.5], atol=1e-6)
    assert np.all(np.asarray(got[1:]) == 0.0)


@pytest.mark.parametrize(
    ("estimator", "want"),
    [
        # Group 0 = [4, 0]: mean 2, deviations [2, -2], Bessel std sqrt(8 / 1) = 2 sqrt(2).
        # Group 1 = [1, 2, 3] laid out non-contiguously. Group 2 = [7] alone: 0. Group 3: unused.
        ("grpo", [1 / math.sqrt(2), -1.0, -1 / math.sqrt(2), 0.0, 0.0, 1.0]),
        ("dr_grpo", [2.0, -1.0, -2.0, 0.0, 0.0, 1.0]),
        # RLOO: 4 - 0 = 4, 0 - 4 = -4; [1, 2, 3] as above.
        ("rloo", [4.0, -1.5, -4.0, 0.0, 0.0, 1.5]),
    ],
)
def test_episode_advantages_with_group_ids(estimator: str, want: list[float]) -> None:
    rewards = np.array([4.0, 1.0, 0.0, 7.0, 2.0, 3.0], np.float32)
    group_ids = np.array([0, 1, 0, 2, 1, 1], np.int32)
    got = episode_advantages(rewards, group_ids, num_groups=4, estimator=estimator)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert not np.any(np.isnan(np.asarray(got)))


def test_episode_advantages_jit_and_unknown_estimator() -> None:
    fn = jax.jit(episode_advantages, static_argnames=("num_groups", "estimator"))
    got = fn(jnp.array([0.0, 1.0]), jnp.array([0, 0]), num_groups=1, estimator="dr_grpo")
    np.testing.assert_allclose(got, [-0.5, 0.5])
    with pytest.raises(ValueError, match="gae"):
        episode_advantages(jnp.zeros(2), jnp.zeros(2, jnp.int32), num_groups=1, estimator="gae")


def test_group_has_variance_is_dapo_dynamic_sampling_filter() -> None:
    np.testing.assert_array_equal(group_has_variance(GROUPED), [True, False, False])
    rewards = np.array([1.0, 1.0, 0.0, 2.0, 2.0], np.float32)
    group_ids = np.array([0, 0, 0, 1, 1], np.int32)
    np.testing.assert_array_equal(
        episode_group_has_variance(rewards, group_ids, num_groups=2),
        [True, True, True, False, False],
    )


def test_overlong_penalty_ramps_over_the_buffer() -> None:
    config = OverlongConfig(max_response_tokens=10, buffer_tokens=4, penalty=0.5)
    lengths = np.array([3, 6, 7, 8, 10, 11], np.int32)
    # No penalty up to 10 - 4 = 6 tokens; then -(L - 6) / 4 * 0.5; -0.5 from 10 tokens on.
    want = [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    np.testing.assert_allclose(overlong_penalty(lengths, config), want, atol=1e-7)


# Two packed rows of T = 7 with M = 3 segments. Row 1's segment 2 has no loss tokens.
SEGMENT_IDS = np.array([[1, 1, 1, 2, 2, 0, 0], [1, 1, 2, 2, 3, 3, 3]], np.int32)
LOSS_MASK = np.array([[0, 1, 1, 0, 1, 0, 0], [0, 1, 0, 0, 0, 1, 1]], bool)
EPISODE_INDEX = np.array([[2, 0, -1], [1, 3, 4]], np.int32)
EPISODE_VALUES = np.array([10.0, 11.0, 12.0, 13.0, 14.0], np.float32)


def test_broadcast_to_tokens_places_episode_values_on_loss_tokens() -> None:
    got = broadcast_to_tokens(EPISODE_VALUES, EPISODE_INDEX, SEGMENT_IDS, LOSS_MASK)
    want = [[0, 12, 12, 0, 10, 0, 0], [0, 11, 0, 0, 0, 14, 14]]
    np.testing.assert_array_equal(got, want)


def test_episode_rewards_land_on_the_last_loss_token_of_each_segment() -> None:
    got = episode_rewards_to_token_rewards(EPISODE_VALUES, EPISODE_INDEX, SEGMENT_IDS, LOSS_MASK)
    # Row 0: segment 1's last loss token is t=2 (episode 2), segment 2's is t=4 (episode 0).
    # Row 1: t=1 (episode 1); segment 2 has none, so episode 3's reward is nowhere; t=6 (episode 4).
    want = [[0, 0, 12, 0, 10, 0, 0], [0, 11, 0, 0, 0, 0, 14]]
    np.testing.assert_array_equal(got, want)
