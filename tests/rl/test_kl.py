"""KL estimators k1, k2, k3 and the KL reward penalty, by hand and against the exact KL."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nonstop.rl import kl_estimate, kl_penalized_rewards

LN2 = math.log(2.0)
# log_ratio = logprobs - ref = [0, ln 2, -ln 2]; the fourth token is padding with -inf logprobs.
LOGPROBS = np.array([[math.log(0.5), math.log(0.5), math.log(0.25), -np.inf]], np.float32)
REF = np.array([[math.log(0.5), math.log(0.25), math.log(0.5), 0.0]], np.float32)
MASK = np.array([[1, 1, 1, 0]], bool)


@pytest.mark.parametrize(
    ("estimator", "want"),
    [
        ("k1", [0.0, LN2, -LN2, 0.0]),  # log_ratio
        ("k2", [0.0, 0.5 * LN2**2, 0.5 * LN2**2, 0.0]),  # 0.5 * 0.693147^2 = 0.240227
        # exp(-d) + d - 1: d = ln 2 -> 0.5 + 0.693147 - 1 = 0.193147;
        #                  d = -ln 2 -> 2 - 0.693147 - 1 = 0.306853.
        ("k3", [0.0, 0.5 + LN2 - 1.0, 2.0 - LN2 - 1.0, 0.0]),
    ],
)
def test_estimators_by_hand(estimator: str, want: list[float]) -> None:
    got = kl_estimate(LOGPROBS, REF, MASK, estimator=estimator)
    np.testing.assert_allclose(got[0], want, atol=1e-6)


def test_k3_gradient_and_masked_padding_is_nan_free() -> None:
    def total(logprobs: jax.Array) -> jax.Array:
        return jnp.sum(kl_estimate(logprobs, REF, MASK, estimator="k3"))

    grad = jax.grad(total)(jnp.asarray(LOGPROBS))
    # d/d logprobs of exp(-d) + d - 1 is 1 - exp(-d): 0, 1 - 0.5, 1 - 2; padding 0.
    np.testing.assert_allclose(grad[0], [0.0, 0.5, -1.0, 0.0], atol=1e-6)


def test_log_ratio_is_clamped_so_k3_stays_finite() -> None:
    got = kl_estimate(
        np.array([[-60.0]], np.float32), np.array([[0.0]], np.float32), np.ones((1, 1), bool),
        estimator="k3",
    )  # fmt: skip
    # d = -60 is clamped to -20: exp(20) - 20 - 1.
    np.testing.assert_allclose(got, [[math.exp(20.0) - 21.0]], rtol=1e-6)


def test_expectations_under_the_policy_match_the_exact_kl() -> None:
    # p = [0.5, 0.25, 0.25], q = [0.25, 0.5, 0.25] over three tokens.
    # KL(p || q) = 0.5 ln 2 + 0.25 ln 0.5 + 0 = 0.25 ln 2 = 0.173287.
    # E_p[k1] = KL; E_p[k3] = sum q - 1 + KL = KL (both unbiased);
    # E_p[k2] = 0.5 * (0.5 + 0.25) * ln(2)^2 = 0.180170 (biased).
    p = np.array([0.5, 0.25, 0.25], np.float32)
    q = np.array([0.25, 0.5, 0.25], np.float32)
    logp, logq, mask = np.log(p)[None], np.log(q)[None], np.ones((1, 3), bool)
    expected = {"k1": 0.25 * LN2, "k2": 0.375 * LN2**2, "k3": 0.25 * LN2}
    for estimator, want in expected.items():
        got = float(jnp.sum(p * kl_estimate(logp, logq, mask, estimator=estimator)[0]))
        assert got == pytest.approx(want, abs=1e-6), estimator


def test_kl_as_reward_penalty_subtracts_beta_kl_without_gradient() -> None:
    rewards = np.array([[0.0, 0.0, 1.0, 7.0]], np.float32)

    def penalized(logprobs: jax.Array) -> jax.Array:
        return kl_penalized_rewards(rewards, logprobs, REF, MASK, coef=0.1, estimator="k1")

    got = penalized(jnp.asarray(LOGPROBS))
    # [0 - 0.1*0, 0 - 0.1*ln2, 1 + 0.1*ln2, 7 (padding untouched)]
    np.testing.assert_allclose(got[0], [0.0, -0.1 * LN2, 1.0 + 0.1 * LN2, 7.0], atol=1e-6)
    grad = jax.grad(lambda lp: jnp.sum(penalized(lp)))(jnp.asarray(LOGPROBS))
    np.testing.assert_array_equal(grad, np.zeros_like(LOGPROBS))


def test_unknown_estimator_is_an_error() -> None:
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(LOGPROBS, REF, MASK, estimator="k4")
