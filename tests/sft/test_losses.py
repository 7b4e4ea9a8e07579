"""Losses against values worked out by hand on tiny inputs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nonstop.models.validation import ConfigError
from nonstop.sft.losses import (
    DPOConfig,
    PairLogprobs,
    SequenceLogprobs,
    dpo_loss,
    masked_cross_entropy,
    orpo_loss,
    preference_pairs,
    sequence_logprobs,
)
from nonstop.train.logprobs import token_logprobs

LN2 = math.log(2.0)
V = 5


def _peaked_logits(predictions: list[int]) -> np.ndarray:
    """float32[T,V]: logit ln 4 on the predicted token, 0 elsewhere.

    softmax denominator = 4 + (V - 1) * 1 = 8, so log p = ln 4 - ln 8 = -ln 2 on the predicted
    token and 0 - ln 8 = -3 ln 2 on any other.
    """
    logits = np.zeros((len(predictions), V), np.float32)
    logits[np.arange(len(predictions)), predictions] = math.log(4.0)
    return logits


@pytest.fixture(scope="module")
def ce_batch():
    # Row 0: segment 1 = tokens [1, 2, 3], segment 2 = [4, 1], then 2 padding slots.
    # Row 1: one segment [2, 3, 4, 2, 1, 3, 4] whose first 3 tokens are a prompt (no loss).
    tokens = np.array([[1, 2, 3, 4, 1, 0, 0], [2, 3, 4, 2, 1, 3, 4]], np.int32)
    segment_ids = np.array([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]], np.int32)
    # loss_mask is (deliberately) set on first tokens too: target_mask must drop them.
    loss_mask = np.array([[1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1]], bool)
    # Position p predicts token p + 1.
    # Row 0: p0 predicts 2 (right: ln2), p1 predicts 4 (wrong: 3ln2), p2 predicts 4, which *is*
    # the next token but crosses the segment boundary (not counted), p3 predicts 1 (right: ln2),
    # p4.. predict padding (not counted). Sum = 5 ln2 over 3 targets.
    row0 = _peaked_logits([2, 4, 4, 1, 0, 0, 0])
    # Row 1 targets are tokens 3..6 = [2, 1, 3, 4] predicted from p2..p5:
    # p2 predicts 2 (ln2), p3 predicts 3 (3ln2), p4 predicts 3 (ln2), p5 predicts 1 (3ln2).
    # p0, p1 predict prompt tokens (not counted). Sum = 8 ln2 over 4 targets.
    row1 = _peaked_logits([0, 0, 2, 3, 3, 1, 0])
    logits = np.stack([row0, row1])
    return logits, tokens, loss_mask, segment_ids


def test_token_logprobs_aligned_with_tokens(ce_batch):
    logits, tokens, _, _ = ce_batch
    logp = np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray(tokens)))
    assert logp.shape == tokens.shape
    # Column 0 has no predecessor; row 0 col 1 is token 2 predicted right (-ln2), col 2 is
    # token 3 where 4 was predicted (-3ln2).
    np.testing.assert_allclose(logp[0, :3], [0.0, -LN2, -3 * LN2], rtol=1e-6)


def test_masked_cross_entropy_with_packing(ce_batch):
    loss = jax.jit(masked_cross_entropy)(*map(jnp.asarray, ce_batch))
    # 5 ln2 (row 0) + 8 ln2 (row 1) = 13 ln2 over 3 + 4 = 7 targets.
    np.testing.assert_allclose(float(loss.total), 13 * LN2, rtol=1e-6)
    assert float(loss.count) == 7.0
    np.testing.assert_allclose(float(loss.mean), 13 * LN2 / 7, rtol=1e-6)


def test_cross_entropy_exact_under_accumulation(ce_batch):
    logits, tokens, loss_mask, segment_ids = ce_batch
    parts = [
        masked_cross_entropy(
            logits[i : i + 1], tokens[i : i + 1], loss_mask[i : i + 1], segment_ids[i : i + 1]
        )
        for i in range(2)
    ]
    total = sum(float(p.total) for p in parts)
    count = sum(float(p.count) for p in parts)
    # (5 ln2 + 8 ln2) / (3 + 4), not the mean of the per-row means (5/3 + 2) ln2 / 2.
    np.testing.assert_allclose(total / count, 13 * LN2 / 7, rtol=1e-6)


def test_cross_entropy_gradient_ignores_padding_and_boundary(ce_batch):
    logits, tokens, loss_mask, segment_ids = map(jnp.asarray, ce_batch)
    grad = jax.grad(lambda x: masked_cross_entropy(x, tokens, loss_mask, segment_ids).mean)(logits)
    grad = np.asarray(grad)
    # Row 0: positions 2 (boundary), 4, 5, 6 (predicting padding) must get no gradient.
    assert np.all(grad[0, [2, 4, 5, 6]] == 0)
    assert np.all(grad[0, [0, 1, 3]] != 0)
    # Row 1: positions 0 and 1 predict prompt tokens, 6 predicts past the end.
    assert np.all(grad[1, [0, 1, 6]] == 0)


def test_sequence_logprobs_per_segment():
    # Target log-probs aligned with tokens; one row of three segments and padding, M = 4.
    target_logprobs = jnp.array([[9.0, -1.0, -2.0, 9.0, -3.0, 9.0, -4.0, -5.0, 9.0]])
    segment_ids = jnp.array([[1, 1, 1, 2, 2, 3, 3, 3, 0]])
    loss_mask = jnp.array([[1, 1, 1, 1, 1, 1, 0, 1, 1]], bool)
    out = jax.jit(sequence_logprobs, static_argnums=3)(target_logprobs, loss_mask, segment_ids, 4)
    # Segment 1: -1 + -2 (its first token's 9 is not a target); segment 2: -3;
    # segment 3: -5 (token 6 is not in the loss mask); segment 4: absent; padding dropped.
    np.testing.assert_allclose(np.asarray(out.logp_sum), [[-3.0, -3.0, -5.0, 0.0]])
    np.testing.assert_allclose(np.asarray(out.count), [[2.0, 1.0, 1.0, 0.0]])
    # With M = 2 the third segment is out of range and dropped, not folded into another.
    out2 = sequence_logprobs(target_logprobs, loss_mask, segment_ids, 2)
    np.testing.assert_allclose(np.asarray(out2.logp_sum), [[-3.0, -3.0]])


def test_preference_pairs_reads_odd_and_even_segments():
    sequences = SequenceLogprobs(
        logp_sum=jnp.array([[-2.0, -6.0, -1.0, 0.0]]), count=jnp.array([[2.0, 3.0, 1.0, 0.0]])
    )
    pairs = preference_pairs(sequences)
    np.testing.assert_allclose(np.asarray(pairs.chosen), [-2.0, -1.0])
    np.testing.assert_allclose(np.asarray(pairs.rejected), [-6.0, 0.0])
    # Pair 1's rejected side has no target: not a valid pair.
    assert np.asarray(pairs.mask).tolist() == [True, False]
    averaged = preference_pairs(sequences, average=True)
    np.testing.assert_allclose(np.asarray(averaged.chosen), [-1.0, -1.0])
    np.testing.assert_allclose(np.asarray(averaged.rejected), [-2.0, 0.0])


def _pairs(chosen, rejected, counts=None):
    n = len(chosen)
    counts = counts or [(1.0, 1.0)] * n
    return PairLogprobs(
        chosen=jnp.array(chosen, jnp.float32),
        rejected=jnp.array(rejected, jnp.float32),
        chosen_count=jnp.array([c for c, _ in counts], jnp.float32),
        rejected_count=jnp.array([r for _, r in counts], jnp.float32),
        mask=jnp.array([c > 0 and r > 0 for c, r in counts]),
    )


# beta = 0.5. Pair 1: policy (chosen, rejected) = (-1, -3), reference (-2, -2):
#   log-ratios chosen 1, rejected -1, logits 2, z = beta * logits = 1.
# Pair 2: policy (-2, -1), reference (-1, -3): ratios -1 and 2, logits -3, z = -1.5.
# Pair 3: padding (zero counts) with absurd values that must not count.
POLICY = _pairs([-1.0, -2.0, 50.0], [-3.0, -1.0, -50.0], [(2, 3), (1, 4), (0, 0)])
REFERENCE = _pairs([-2.0, -1.0, 0.0], [-2.0, -3.0, 0.0], [(2, 3), (1, 4), (0, 0)])
SP1 = math.log1p(math.exp(-1.0))  # -log sigmoid(1) = 0.3132617
SP2 = math.log1p(math.exp(1.5))  # -log sigmoid(-1.5) = 1.7014132


@pytest.mark.parametrize(
    ("loss_type", "smoothing", "expected_total"),
    [
        ("sigmoid", 0.0, SP1 + SP2),
        # cDPO: (1 - eps) * -log sig(z) + eps * -log sig(-z), and -log sig(-z) = z + -log sig(z):
        # pair 1: 0.8 * SP1 + 0.2 * (1 + SP1) = SP1 + 0.2
        # pair 2: 0.8 * SP2 + 0.2 * (SP2 - 1.5) = SP2 - 0.3
        ("sigmoid", 0.2, SP1 + 0.2 + SP2 - 0.3),
        # IPO: (logits - 1 / (2 beta))^2 = (2 - 1)^2 + (-3 - 1)^2 = 1 + 16.
        ("ipo", 0.0, 17.0),
        # hinge: relu(1 - z) = relu(0) + relu(2.5).
        ("hinge", 0.0, 2.5),
    ],
)
def test_dpo_variants(loss_type, smoothing, expected_total):
    config = DPOConfig(loss_type=loss_type, beta=0.5, label_smoothing=smoothing)
    loss, _ = jax.jit(dpo_loss, static_argnums=2)(POLICY, REFERENCE, config)
    np.testing.assert_allclose(float(loss.total), expected_total, rtol=1e-6)
    assert float(loss.count) == 2.0
    np.testing.assert_allclose(float(loss.mean), expected_total / 2, rtol=1e-6)


def test_dpo_metrics():
    _, metrics = dpo_loss(POLICY, REFERENCE, DPOConfig(beta=0.5))
    # rewards = beta * log-ratio: chosen (0.5, -0.5), rejected (-0.5, 1.0);
    # margins (1.0, -1.5); only pair 1 has chosen above rejected.
    np.testing.assert_allclose(float(metrics.rewards_chosen), 0.0, atol=1e-7)
    np.testing.assert_allclose(float(metrics.rewards_rejected), 0.25, rtol=1e-6)
    np.testing.assert_allclose(float(metrics.margins), -0.25, rtol=1e-6)
    np.testing.assert_allclose(float(metrics.accuracy), 0.5)
    np.testing.assert_allclose(float(metrics.logps_chosen), -1.5)
    np.testing.assert_allclose(float(metrics.logps_rejected), -2.0)


def test_dpo_reference_free():
    config = DPOConfig(beta=0.5, reference_free=True)
    loss, metrics = dpo_loss(POLICY, None, config)
    # logits = policy chosen - policy rejected: 2 and -1, z = 1 and -0.5.
    expected = math.log1p(math.exp(-1.0)) + math.log1p(math.exp(0.5))  # 0.3132617 + 0.9740770
    np.testing.assert_allclose(float(loss.total), expected, rtol=1e-6)
    # rewards = beta * policy log-probs: chosen (-0.5, -1.0), rejected (-1.5, -0.5).
    np.testing.assert_allclose(float(metrics.rewards_chosen), -0.75)
    np.testing.assert_allclose(float(metrics.rewards_rejected), -1.0)
    np.testing.assert_allclose(float(metrics.margins), 0.25)
    np.testing.assert_allclose(float(metrics.accuracy), 0.5)


def test_dpo_reference_mismatch_and_config_errors():
    with pytest.raises(ValueError, match="reference_free=True"):
        dpo_loss(POLICY, REFERENCE, DPOConfig(reference_free=True))
    with pytest.raises(ValueError, match="reference_free=False"):
        dpo_loss(POLICY, None, DPOConfig())
    with pytest.raises(ConfigError, match=r"^DPOConfig\.label_smoothing=0\.1 is invalid; expected "
                                          r"0\.0 with loss_type='ipo'"):
        DPOConfig(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ConfigError, match=r"^DPOConfig\.loss_type='kto' is invalid; expected one "
                                          r"of 'sigmoid', 'ipo', 'hinge'"):
        DPOConfig(loss_type="kto")
    with pytest.raises(ConfigError, match=r"^DPOConfig\.beta=0\.0 is invalid; expected a float > 0"):
        DPOConfig(beta=0.0)


def test_orpo():
    # Pair 1: chosen 2 targets summing 2 ln(1/2) -> average ln(1/2), P = 1/2, odds 1, log odds 0;
    #         rejected 3 targets summing 3 ln(1/4) -> P = 1/4, odds 1/3, log odds -ln 3.
    #         log odds ratio = ln 3; log sigmoid(ln 3) = ln(3/4).
    # Pair 2: chosen 1 target ln(1/4) -> log odds -ln 3; rejected 4 targets averaging ln(1/2)
    #         -> log odds 0; log odds ratio = -ln 3; log sigmoid(-ln 3) = ln(1/4).
    # Pair 3: padding.
    policy = _pairs(
        [2 * math.log(0.5), math.log(0.25), 7.0],
        [3 * math.log(0.25), 4 * math.log(0.5), 7.0],
        [(2, 3), (1, 4), (0, 0)],
    )
    loss, metrics = jax.jit(orpo_loss)(policy)
    # NLL over all chosen targets: -(2 ln(1/2) + ln(1/4)) / 3 = 4 ln2 / 3.
    np.testing.assert_allclose(float(loss.nll.total), 4 * LN2, rtol=1e-6)
    assert float(loss.nll.count) == 3.0
    # Odds-ratio term: -(ln(3/4) + ln(1/4)) over 2 pairs.
    odds_total = -(math.log(0.75) + math.log(0.25))
    np.testing.assert_allclose(float(loss.odds_ratio.total), odds_total, rtol=1e-6)
    assert float(loss.odds_ratio.count) == 2.0
    np.testing.assert_allclose(
        float(loss.total(0.1)), 4 * LN2 / 3 + 0.1 * odds_total / 2, rtol=1e-6
    )
    np.testing.assert_allclose(float(metrics.log_odds_chosen), 0.0, atol=1e-6)  # (ln3 - ln3)/2
    np.testing.assert_allclose(
        float(metrics.log_odds_ratio), (math.log(0.75) + math.log(0.25)) / 2, rtol=1e-6
    )
    np.testing.assert_allclose(float(metrics.logps_chosen), (math.log(0.5) + math.log(0.25)) / 2)
    # Gradients stay finite even with padding pairs holding nonsense values.
    grads = jax.grad(lambda c: orpo_loss(policy._replace(chosen=c))[0].total(0.1))(policy.chosen)
    assert np.all(np.isfinite(np.asarray(grads)))
    assert float(grads[2]) == 0.0
