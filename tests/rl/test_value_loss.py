"""GAE over packed multi-turn rows, the clipped value loss, entropy and whitening."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nonstop.rl import entropy, gae, masked_whiten, token_entropy, value_loss

# Row 0: segment 1 = [prompt, gen, tool observation, gen], segment 2 = [prompt, gen, gen], pad.
# Row 1: all masked. Values on non-loss tokens are 9 and must be ignored.
SEGMENT_IDS = np.array([[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0, 0, 0]], np.int32)
LOSS_MASK = np.array([[0, 1, 0, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0]], bool)
REWARDS = np.array([[0, 0, 0, 1, 0, 0, 2, 0], [0] * 8], np.float32)
VALUES = np.array([[9, 0.5, 9, 0.8, 9, 0.3, 0.6, 9], [9] * 8], np.float32)


def test_gae_by_hand_skips_observations_and_resets_at_segments() -> None:
    advantages, returns = gae(REWARDS, VALUES, LOSS_MASK, SEGMENT_IDS, gamma=0.9, lam=0.5)
    # Segment 1, right to left:
    #   t=3: delta = 1 + 0.9*0 - 0.8 = 0.2 (segment ends)                A = 0.2
    #   t=2: observation, passes V_next = 0.8 and A_next = 0.2 through
    #   t=1: delta = 0 + 0.9*0.8 - 0.5 = 0.22;  A = 0.22 + 0.9*0.5*0.2 = 0.31
    # Segment 2:
    #   t=6: delta = 2 - 0.6 = 1.4                                          A = 1.4
    #   t=5: delta = 0 + 0.9*0.6 - 0.3 = 0.24;  A = 0.24 + 0.45*1.4 = 0.87
    want = [[0, 0.31, 0, 0.2, 0, 0.87, 1.4, 0], [0] * 8]
    np.testing.assert_allclose(advantages, want, atol=1e-6)
    # returns = A + V on loss tokens.
    want_returns = [[0, 0.81, 0, 1.0, 0, 1.17, 2.0, 0], [0] * 8]
    np.testing.assert_allclose(returns, want_returns, atol=1e-6)


def test_gae_with_gamma_lambda_one_is_monte_carlo_return_minus_value() -> None:
    advantages, _ = gae(REWARDS, VALUES, LOSS_MASK, SEGMENT_IDS, gamma=1.0, lam=1.0)
    # Reward-to-go minus V: segment 1 -> 1 - 0.5, 1 - 0.8; segment 2 -> 2 - 0.3, 2 - 0.6.
    np.testing.assert_allclose(advantages[0], [0, 0.5, 0, 0.2, 0, 1.7, 1.4, 0], atol=1e-6)


def _reference_gae(rewards, values, mask, segments, gamma, lam):  # noqa: ANN001, ANN202
    """Plain Python GAE: per segment, over its loss tokens only, as separate time steps."""
    out = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        for segment in set(segments[b].tolist()) - {0}:
            steps = [t for t in range(rewards.shape[1]) if segments[b, t] == segment and mask[b, t]]
            running, next_value = 0.0, 0.0
            for t in reversed(steps):
                delta = rewards[b, t] + gamma * next_value - values[b, t]
                running = delta + gamma * lam * running
                out[b, t], next_value = running, values[b, t]
    return out


def test_gae_matches_a_plain_python_reference_on_random_packed_rows() -> None:
    rng = np.random.default_rng(3)
    segments = np.array(
        [[1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 0], [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]], np.int32
    )
    mask = (rng.random(segments.shape) < 0.7) & (segments > 0)
    rewards = rng.normal(size=segments.shape).astype(np.float32)
    values = rng.normal(size=segments.shape).astype(np.float32)
    got, _ = jax.jit(gae, static_argnames=("gamma", "lam"))(
        rewards, values, mask, segments, gamma=0.97, lam=0.9
    )
    want = _reference_gae(rewards, values, mask, segments, 0.97, 0.9)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_clipped_value_loss_by_hand_with_gradients() -> None:
    old_values = np.array([[0.9, 2.5, 0.5, 0.0]], np.float32)
    returns = np.array([[1.5, 1.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 0]], bool)
    segments = np.array([[1, 1, 1, 0]], np.int32)

    def loss(values: jax.Array, clip_eps: float | None) -> jax.Array:
        return value_loss(
            values, old_values=old_values, returns=returns, loss_mask=mask,
            segment_ids=segments, clip_eps=clip_eps, max_segments=1,
        ).value()  # fmt: skip

    values = jnp.array([[1.0, 2.0, 0.5, 5.0]])
    # t0: (1 - 1.5)^2 = 0.25; clipped V = 0.9 + 0.1 = 1.0, the same          -> 0.5 * 0.25
    # t1: (2 - 1)^2 = 1; clipped V = 2.5 - 0.2 = 2.3 -> (2.3 - 1)^2 = 1.69    -> 0.5 * 1.69
    # t2: (0.5 - 0)^2 = 0.25, inside the clip range                          -> 0.5 * 0.25
    # token mean: (0.125 + 0.845 + 0.125) / 3 = 0.365; unclipped (0.125 + 0.5 + 0.125) / 3 = 0.25
    assert float(loss(values, 0.2)) == pytest.approx(0.365, abs=1e-6)
    assert float(loss(values, None)) == pytest.approx(0.25, abs=1e-6)
    # Gradient (V - R) / 3 where the unclipped term is active; 0 at t1 (clipped branch saturated).
    grad = jax.grad(loss)(values, 0.2)
    np.testing.assert_allclose(grad[0], [-0.5 / 3, 0.0, 0.5 / 3, 0.0], atol=1e-6)


def test_entropy_from_logits_masked_mean() -> None:
    v = 5
    logits = np.full((1, 3, v), -np.inf, np.float32)
    logits[0, 0] = 0.0  # uniform over 5: ln 5
    logits[0, 1, :3] = np.log([0.5, 0.25, 0.25])  # 0.5 ln 2 + 0.5 ln 4 = 1.5 ln 2
    logits[0, 2] = np.array([3.0, 1.0, 0.0, -1.0, 2.0])  # masked out
    per_token = token_entropy(logits)
    np.testing.assert_allclose(per_token[0, :2], [math.log(5), 1.5 * math.log(2)], atol=1e-6)
    mask = np.array([[1, 1, 0]], bool)
    assert float(entropy(logits, mask)) == pytest.approx(
        (math.log(5) + 1.5 * math.log(2)) / 2, abs=1e-6
    )
    grad = jax.grad(lambda x: entropy(x, mask))(jnp.asarray(logits))
    assert np.all(np.isfinite(np.asarray(grad)))
    # The uniform distribution is the entropy maximum: zero gradient there.
    np.testing.assert_allclose(grad[0, 0], np.zeros(v), atol=1e-6)
    assert float(entropy(logits, np.zeros((1, 3), bool))) == 0.0


def test_masked_whiten() -> None:
    values = np.array([[1.0, 2.0, 3.0, 99.0]], np.float32)
    mask = np.array([[1, 1, 1, 0]], bool)
    # mean 2, variance (1 + 0 + 1) / 3 = 2/3 -> (x - 2) / sqrt(2/3) = [-1.224745, 0, 1.224745]
    scale = 1 / math.sqrt(2 / 3)
    np.testing.assert_allclose(masked_whiten(values, mask)[0], [-scale, 0.0, scale, 0.0], atol=1e-5)
