"""Per-segment reductions on packed rows and the three aggregation modes, incl. accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nonstop.rl import (
    LossTerms,
    aggregate,
    aggregation_denominator,
    num_sequences,
    segment_mean,
    segment_sum,
    segments_to_tokens,
)

M = 3  # max segments per row
# Row 0: two sequences. Row 1: three, the second without loss tokens. Row 2: all masked.
SEGMENT_IDS = np.array(
    [[1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 2, 2, 3], [1, 1, 1, 0, 0, 0, 0]], np.int32
)
LOSS_MASK = np.array([[0, 1, 1, 0, 1, 1, 0], [0, 1, 1, 1, 0, 0, 1], [0, 0, 0, 0, 0, 0, 0]], bool)
# 9 marks tokens outside the loss mask: they must never count.
LOSS = np.array([[9, 1, 3, 9, 2, 4, 9], [9, 6, 0, 3, 9, 9, 5], [9, 9, 9, 9, 9, 9, 9]], np.float32)
# Loss tokens per sequence: (1, 3) (2, 4) | (6, 0, 3) () (5) | -> sums 4, 6, 9, 5; means 2, 3, 3, 5.


def test_segment_sum_and_mean_per_packed_sequence() -> None:
    masked = np.where(LOSS_MASK, LOSS, 0.0)
    np.testing.assert_array_equal(
        segment_sum(masked, SEGMENT_IDS, M), [[4, 6, 0], [9, 0, 5], [0, 0, 0]]
    )
    np.testing.assert_array_equal(
        segment_mean(LOSS, LOSS_MASK, SEGMENT_IDS, M), [[2, 3, 0], [3, 0, 5], [0, 0, 0]]
    )
    assert float(num_sequences(LOSS_MASK, SEGMENT_IDS, M)) == 4.0
    np.testing.assert_array_equal(
        segments_to_tokens(np.array([[10.0, 20.0, 30.0]]), SEGMENT_IDS[:1]),
        [[10, 10, 10, 20, 20, 20, 0]],
    )


def test_segment_ids_above_max_segments_do_not_alias_into_the_next_row() -> None:
    # With M = 1 the flat width is 2, so id 3 in row 0 would land on row 1's segment 1.
    got = segment_sum(np.ones((2, 2), np.float32), np.array([[1, 3], [1, 1]], np.int32), 1)
    np.testing.assert_array_equal(got, [[1], [2]])


@pytest.mark.parametrize(
    ("mode", "numerator", "denominator"),
    [
        ("token_mean", 24.0, 8.0),  # (4 + 6 + 9 + 5) / 8 loss tokens = 3
        ("seq_mean_token_mean", 13.0, 4.0),  # (2 + 3 + 3 + 5) / 4 sequences = 3.25
        ("seq_mean_token_sum_norm", 24.0, 20.0),  # 24 / (4 sequences * max_len_norm 5) = 1.2
    ],
)
def test_aggregation_modes_by_hand(mode: str, numerator: float, denominator: float) -> None:
    terms = aggregate(LOSS, LOSS_MASK, SEGMENT_IDS, mode=mode, max_segments=M, max_len_norm=5)
    assert float(terms.numerator) == pytest.approx(numerator)
    assert float(terms.denominator) == pytest.approx(denominator)
    assert float(terms.value()) == pytest.approx(numerator / denominator)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_all_masked_rows_give_zero_loss_and_zero_gradient(mode: str) -> None:
    mask = LOSS_MASK[2:]
    segments = SEGMENT_IDS[2:]

    def loss(scale: jax.Array) -> jax.Array:
        # NaN on masked tokens (garbage in padding) must not leak into the value or the gradient.
        per_token = scale * jnp.ones(mask.shape) + jnp.where(mask, 0.0, jnp.nan)
        return aggregate(
            per_token, mask, segments, mode=mode, max_segments=M, max_len_norm=5
        ).value()

    value, grad = jax.value_and_grad(loss)(jnp.float32(2.0))
    assert float(value) == 0.0 and float(grad) == 0.0


def test_unknown_mode_and_missing_length_are_errors() -> None:
    with pytest.raises(ValueError, match="sum_mean"):
        aggregation_denominator(LOSS_MASK, SEGMENT_IDS, mode="sum_mean", max_segments=M)
    with pytest.raises(ValueError, match="max_len_norm"):
        aggregation_denominator(
            LOSS_MASK, SEGMENT_IDS, mode="seq_mean_token_sum_norm", max_segments=M
        )


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_accumulation_over_micro_batches_is_exact(mode: str) -> None:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(4, 7, 5)).astype(np.float32)
    segments = np.concatenate([SEGMENT_IDS, [[1, 1, 2, 2, 2, 3, 3]]]).astype(np.int32)
    mask = np.concatenate([LOSS_MASK, [[0, 1, 0, 1, 1, 1, 1]]]).astype(bool)
    weights = jnp.asarray(rng.normal(size=(5,)).astype(np.float32))

    def terms(w: jax.Array, rows: slice, denominator: jax.Array | None = None) -> LossTerms:
        per_token = jnp.tanh(features[rows] @ w) ** 2
        return aggregate(
            per_token,
            mask[rows],
            segments[rows],
            mode=mode,
            max_segments=M,
            max_len_norm=5,
            denominator=denominator,
        )

    full = slice(0, 4)
    micro = [slice(0, 1), slice(1, 3), slice(3, 4)]  # uneven split, all-masked row inside one
    full_loss, full_grad = jax.value_and_grad(lambda w: terms(w, full).value())(weights)

    # (a) sum numerators and denominators over micro-batches, divide at the end.
    summed = terms(weights, micro[0]) + terms(weights, micro[1]) + terms(weights, micro[2])
    assert float(summed.value()) == pytest.approx(float(full_loss), abs=1e-6)

    # (b) global denominator computed up front; micro-batch losses and gradients just add up.
    den = aggregation_denominator(mask, segments, mode=mode, max_segments=M, max_len_norm=5)
    loss_sum, grad_sum = 0.0, jnp.zeros_like(weights)
    for rows in micro:
        loss, grad = jax.value_and_grad(lambda w, r=rows: terms(w, r, den).value())(weights)
        loss_sum, grad_sum = loss_sum + loss, grad_sum + grad
    assert float(loss_sum) == pytest.approx(float(full_loss), abs=1e-6)
    np.testing.assert_allclose(grad_sum, full_grad, atol=1e-6)

    # A mean of micro-batch means is not the full-batch mean: the test can tell them apart.
    naive = np.mean([float(terms(weights, rows).value()) for rows in micro])
    assert abs(naive - float(full_loss)) > 1e-3
