"""Per-segment reductions over packed rows, and loss aggregation that is exact under accumulation.

Rows of a `TrainBatch` pack several sequences: `segment_ids[b, t]` is 0 on padding and 1..M for
the sequences of row b. Sequence-level quantities are computed with `jax.ops.segment_sum` over the
flat index `b * (M + 1) + segment_id`, with `M = max_segments` static; segment ids above M are
ignored (the packer must size M), and a sequence never spans two rows.

Aggregation modes (a loss is `numerator / denominator`):

- `token_mean`: sum of the per-token losses / number of loss tokens.
- `seq_mean_token_mean`: sum over sequences of their token mean / number of sequences.
- `seq_mean_token_sum_norm` (Dr.GRPO): sum of the per-token losses / (number of sequences *
  `max_len_norm`), a constant length.

A "sequence" here is a segment with at least one loss token; one without any contributes nothing
to numerator or denominator.

Exactness under gradient accumulation. Numerators are sums over sequences (each sequence's token
mean only needs that sequence, which lies in one row, hence in one micro-batch), so they add up
across micro-batches. Denominators are global: a mean of micro-batch means is *not* the
full-batch mean. The learner therefore computes `aggregation_denominator` once over the whole
step's batch, before splitting it, and passes that value as `denominator` to every micro-batch;
the micro-batch losses `numerator_i / denominator` then sum to the full-batch loss, and so do
their gradients. Equivalently, accumulate `LossTerms` with `+` and call `.value()` at the end.
"""

from __future__ import annotations

import dataclasses
from typing import get_args

import jax
import jax.numpy as jnp

from nonstop.rl.config import AggregationMode


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossTerms:
    """A loss as `numerator / denominator`, both float32 scalars, summable across micro-batches."""

    numerator: jax.Array
    denominator: jax.Array

    def __add__(self, other: LossTerms) -> LossTerms:
        return LossTerms(self.numerator + other.numerator, self.denominator + other.denominator)

    def value(self) -> jax.Array:
        """numerator / denominator, and 0 when the denominator is 0 (an all-masked batch)."""
        return safe_divide(self.numerator, self.denominator)


def safe_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """numerator / denominator where the denominator is positive, else 0; NaN-free gradients."""
    positive = denominator > 0
    return jnp.where(positive, numerator / jnp.where(positive, denominator, 1.0), 0.0)


def _flat_segment_ids(segment_ids: jax.Array, max_segments: int) -> jax.Array:
    """int32[B*T]: `b * (M + 1) + segment_id`; out-of-range ids map past the end (dropped)."""
    batch, _ = segment_ids.shape
    width = max_segments + 1
    segment_ids = segment_ids.astype(jnp.int32)
    in_range = (segment_ids >= 0) & (segment_ids <= max_segments)
    flat_ids = jnp.arange(batch, dtype=jnp.int32)[:, None] * width + segment_ids
    return jnp.where(in_range, flat_ids, batch * width).reshape(-1)


def segment_sum(values: jax.Array, segment_ids: jax.Array, max_segments: int) -> jax.Array:
    """float32[B,M]: `out[b, s-1]` = sum of `values[b, t]` over tokens with segment id s.

    Padding (segment 0) is dropped, as are ids above `max_segments`.
    """
    batch, _ = values.shape
    width = max_segments + 1
    sums = jax.ops.segment_sum(
        values.reshape(-1),
        _flat_segment_ids(segment_ids, max_segments),
        num_segments=batch * width,
    )
    return sums.reshape(batch, width)[:, 1:]


def segment_max(values: jax.Array, segment_ids: jax.Array, max_segments: int) -> jax.Array:
    """[B,M]: max of `values` over each segment's tokens (the dtype's lowest value if empty)."""
    batch, _ = values.shape
    width = max_segments + 1
    maxima = jax.ops.segment_max(
        values.reshape(-1),
        _flat_segment_ids(segment_ids, max_segments),
        num_segments=batch * width,
    )
    return maxima.reshape(batch, width)[:, 1:]


def segment_token_counts(
    loss_mask: jax.Array, segment_ids: jax.Array, max_segments: int
) -> jax.Array:
    """float32[B,M]: number of loss tokens in each segment."""
    return segment_sum(loss_mask.astype(jnp.float32), segment_ids, max_segments)


def segment_mean(
    values: jax.Array, loss_mask: jax.Array, segment_ids: jax.Array, max_segments: int
) -> jax.Array:
    """float32[B,M]: mean of `values` over each segment's loss tokens (0 for an empty segment)."""
    masked = jnp.where(loss_mask, values, 0.0).astype(jnp.float32)
    return safe_divide(
        segment_sum(masked, segment_ids, max_segments),
        segment_token_counts(loss_mask, segment_ids, max_segments),
    )


def segments_to_tokens(per_segment: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """[B,T]: each token gets its segment's value from `per_segment` [B,M]; padding gets 0."""
    index = jnp.clip(segment_ids.astype(jnp.int32) - 1, 0, per_segment.shape[1] - 1)
    gathered = jnp.take_along_axis(per_segment, index, axis=1)
    return jnp.where(segment_ids > 0, gathered, jnp.zeros_like(gathered))


def num_sequences(loss_mask: jax.Array, segment_ids: jax.Array, max_segments: int) -> jax.Array:
    """float32[]: number of segments that hold at least one loss token."""
    counts = segment_token_counts(loss_mask, segment_ids, max_segments)
    return jnp.sum((counts > 0).astype(jnp.float32))


def aggregation_numerator(
    per_token_loss: jax.Array,
    loss_mask: jax.Array,
    segment_ids: jax.Array,
    *,
    mode: AggregationMode,
    max_segments: int,
) -> jax.Array:
    """float32[]: the additive part of the aggregated loss (see the module docstring)."""
    masked = jnp.where(loss_mask, per_token_loss, 0.0).astype(jnp.float32)
    if mode in ("token_mean", "seq_mean_token_sum_norm"):
        return jnp.sum(masked)
    if mode == "seq_mean_token_mean":
        return jnp.sum(segment_mean(per_token_loss, loss_mask, segment_ids, max_segments))
    raise ValueError(f"aggregation mode {mode!r} is not one of {get_args(AggregationMode)}")


def aggregation_denominator(
    loss_mask: jax.Array,
    segment_ids: jax.Array,
    *,
    mode: AggregationMode,
    max_segments: int,
    max_len_norm: int | None = None,
) -> jax.Array:
    """float32[]: the denominator of the aggregated loss over the batch given.

    Call it on the whole step's batch (all micro-batches) and pass the result to each micro-batch.
    """
    if mode == "token_mean":
        return jnp.sum(loss_mask.astype(jnp.float32))
    if mode == "seq_mean_token_mean":
        return num_sequences(loss_mask, segment_ids, max_segments)
    if mode == "seq_mean_token_sum_norm":
        if max_len_norm is None or max_len_norm <= 0:
            raise ValueError(
                f"max_len_norm = {max_len_norm!r}: mode 'seq_mean_token_sum_norm' needs a positive "
                "constant length"
            )
        return num_sequences(loss_mask, segment_ids, max_segments) * float(max_len_norm)
    raise ValueError(f"aggregation mode {mode!r} is not one of {get_args(AggregationMode)}")


def aggregate(
    per_token_loss: jax.Array,
    loss_mask: jax.Array,
    segment_ids: jax.Array,
    *,
    mode: AggregationMode,
    max_segments: int,
    max_len_norm: int | None = None,
    denominator: jax.Array | None = None,
) -> LossTerms:
    """Numerator and denominator of `per_token_loss` [B,T] aggregated with `mode`.

    `denominator`, when given, is the global one from `aggregation_denominator` over the step's
    full batch; otherwise it is computed over this batch.
    """
    numerator = aggregation_numerator(
        per_token_loss, loss_mask, segment_ids, mode=mode, max_segments=max_segments
    )
    if denominator is None:
        denominator = aggregation_denominator(
            loss_mask, segment_ids, mode=mode, max_segments=max_segments, max_len_norm=max_len_norm
        )
    return LossTerms(numerator, jnp.asarray(denominator, dtype=jnp.float32))


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """float32[]: mean of `values` where `mask` is true; 0 when nothing is.

    For diagnostics; a loss should go through `aggregate` to stay exact under accumulation.
    """
    masked = jnp.where(mask, values, 0.0).astype(jnp.float32)
    return safe_divide(jnp.sum(masked), jnp.sum(mask.astype(jnp.float32)))
