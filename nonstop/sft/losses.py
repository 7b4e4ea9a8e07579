"""Supervised and preference losses as pure, jittable float32 functions over packed batches.

- `masked_cross_entropy`: next-token NLL over the targets of packed rows (the convention of
  `nonstop.train.batch`), returned as (sum, count) so gradient accumulation over micro-batches
  is exact: add the sums and counts, divide once.
- `sequence_logprobs`: per packed sequence, the sum of its target log-probs and its target count,
  as [B,M] arrays indexed by segment id - 1.
- `preference_pairs`: reads (chosen, rejected) pairs from those [B,M] arrays — the packer puts the
  chosen sequence of pair j of a row on segment 2j+1 and its rejected sequence on 2j+2.
- `dpo_loss` (Rafailov et al., 2023) with the sigmoid loss and conservative label smoothing
  (cDPO), IPO (Azar et al., 2023) and the SLiC hinge, optionally reference-free.
- `orpo_loss` (Hong et al., 2024): NLL of the chosen response plus λ times the odds-ratio term,
  on length-normalised log-probs as in the paper.

Departures: IPO's paper and TRL average log-probs over completion tokens; here every loss takes
whatever per-sequence log-probs it is given, and `preference_pairs(..., average=True)` produces
the averaged ones. Label smoothing is defined only for the sigmoid loss (cDPO) and is rejected
for IPO and hinge. ORPO clips the length-normalised log-prob at −1e-6 so the odds stay finite
when a sequence is predicted with certainty.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from nonstop.models.validation import check, check_choice
from nonstop.train.batch import target_mask
from nonstop.train.logprobs import token_logprobs

_MAX_NORMALISED_LOGP = -1e-6


class MaskedSum(NamedTuple):
    """A loss as (sum over counted items, number of items): exact under accumulation."""

    total: jax.Array  # float32[]
    count: jax.Array  # float32[]

    @property
    def mean(self) -> jax.Array:
        return self.total / jnp.maximum(self.count, 1.0)


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def masked_cross_entropy(
    logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array, segment_ids: jax.Array
) -> MaskedSum:
    """Summed NLL of the valid targets of `tokens` [B,T] under `logits` [B,T,V], and their count."""
    valid = target_mask(loss_mask, segment_ids)
    nll = -token_logprobs(logits, tokens)
    return MaskedSum(
        total=jnp.sum(jnp.where(valid, nll, 0.0)), count=jnp.sum(valid).astype(jnp.float32)
    )


class SequenceLogprobs(NamedTuple):
    """Per packed sequence of each row: summed target log-probs and number of targets."""

    logp_sum: jax.Array  # float32[B,M], sequence m of a row is segment id m + 1
    count: jax.Array  # float32[B,M]


def sequence_logprobs(
    target_logprobs: jax.Array, loss_mask: jax.Array, segment_ids: jax.Array, num_segments: int
) -> SequenceLogprobs:
    """Sums `target_logprobs` [B,T] (aligned with tokens) over each segment's valid targets.

    `num_segments` (M) is the static bound `PackingConfig.max_segments_per_row`; segments beyond
    it are dropped.
    """
    batch = segment_ids.shape[0]
    valid = target_mask(loss_mask, segment_ids)
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    in_range = (segment_ids >= 1) & (segment_ids <= num_segments)
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
    # Flat index row * M + (segment - 1); padding and out-of-range segments point past the end
    # and are dropped by segment_sum.
    flat = jnp.where(in_range, rows * num_segments + segment_ids - 1, batch * num_segments)
    values = jnp.where(valid, target_logprobs.astype(jnp.float32), 0.0)
    shape = (batch, num_segments)
    logp_sum = jax.ops.segment_sum(values.ravel(), flat.ravel(), batch * num_segments)
    count = jax.ops.segment_sum(
        valid.astype(jnp.float32).ravel(), flat.ravel(), batch * num_segments
    )
    return SequenceLogprobs(logp_sum=logp_sum.reshape(shape), count=count.reshape(shape))


class PairLogprobs(NamedTuple):
    """Per preference pair (P = B·M/2): chosen/rejected log-probs, target counts, validity."""

    chosen: jax.Array  # float32[P]
    rejected: jax.Array  # float32[P]
    chosen_count: jax.Array  # float32[P]
    rejected_count: jax.Array  # float32[P]
    mask: jax.Array  # bool[P]: a real pair, both sides with at least one target


def preference_pairs(sequences: SequenceLogprobs, *, average: bool = False) -> PairLogprobs:
    """Splits [B,M] per-sequence log-probs into pairs (odd segment ids chosen, even rejected).

    With `average`, each log-prob is divided by its target count (IPO, ORPO).
    """
    if sequences.logp_sum.shape[-1] % 2:
        raise ValueError(
            f"preference pairs need an even number of segments per row, got "
            f"{sequences.logp_sum.shape[-1]} (set PackingConfig.max_segments_per_row even)"
        )
    logp = sequences.logp_sum
    if average:
        logp = logp / jnp.maximum(sequences.count, 1.0)
    chosen_count = sequences.count[:, 0::2].ravel()
    rejected_count = sequences.count[:, 1::2].ravel()
    return PairLogprobs(
        chosen=logp[:, 0::2].ravel(),
        rejected=logp[:, 1::2].ravel(),
        chosen_count=chosen_count,
        rejected_count=rejected_count,
        mask=(chosen_count > 0) & (rejected_count > 0),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig:
    """Direct preference optimisation and its IPO / hinge variants."""

    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    reference_free: bool = False

    def __post_init__(self) -> None:
        owner = "DPOConfig"
        check_choice(owner, "loss_type", self.loss_type, ("sigmoid", "ipo", "hinge"))
        check(self.beta > 0, owner, "beta", self.beta, "a float > 0")
        check(0.0 <= self.label_smoothing < 0.5, owner, "label_smoothing", self.label_smoothing,
              "a float in [0, 0.5)")
        check(not self.label_smoothing or self.loss_type == "sigmoid", owner, "label_smoothing",
              self.label_smoothing, f"0.0 with loss_type={self.loss_type!r} (label smoothing, "
              "cDPO, is only defined for loss_type='sigmoid')")


class DPOMetrics(NamedTuple):
    """Means over the valid pairs of a batch; rewards are β·(log π − log π_ref)."""

    rewards_chosen: jax.Array
    rewards_rejected: jax.Array
    margins: jax.Array
    accuracy: jax.Array
    logps_chosen: jax.Array
    logps_rejected: jax.Array


def dpo_loss(
    policy: PairLogprobs, reference: PairLogprobs | None, config: DPOConfig
) -> tuple[MaskedSum, DPOMetrics]:
    """DPO-family loss summed over the valid pairs of `policy`, and its metrics.

    `reference` holds the reference model's log-probs of the same pairs — precomputed once per
    example or computed on the fly, the function does not care — and must be None exactly when
    `config.reference_free` (the reference log-ratio is then 0).
    """
    if config.reference_free != (reference is None):
        raise ValueError(
            f"dpo_loss: DPOConfig.reference_free={config.reference_free} but reference log-probs "
            f"were {'given' if reference is not None else 'not given'}"
        )
    chosen_ratio = policy.chosen
    rejected_ratio = policy.rejected
    if reference is not None:
        chosen_ratio = chosen_ratio - reference.chosen
        rejected_ratio = rejected_ratio - reference.rejected
    logits = chosen_ratio - rejected_ratio
    beta = config.beta
    if config.loss_type == "sigmoid":
        eps = config.label_smoothing
        losses = -(1 - eps) * jax.nn.log_sigmoid(beta * logits) - eps * jax.nn.log_sigmoid(
            -beta * logits
        )
    elif config.loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = jax.nn.relu(1 - beta * logits)
    mask = policy.mask
    rewards_chosen = beta * chosen_ratio
    rewards_rejected = beta * rejected_ratio
    metrics = DPOMetrics(
        rewards_chosen=_masked_mean(rewards_chosen, mask),
        rewards_rejected=_masked_mean(rewards_rejected, mask),
        margins=_masked_mean(rewards_chosen - rewards_rejected, mask),
        accuracy=_masked_mean((rewards_chosen > rewards_rejected).astype(jnp.float32), mask),
        logps_chosen=_masked_mean(policy.chosen, mask),
        logps_rejected=_masked_mean(policy.rejected, mask),
    )
    loss = MaskedSum(
        total=jnp.sum(jnp.where(mask, losses, 0.0)), count=jnp.sum(mask).astype(jnp.float32)
    )
    return loss, metrics


@dataclasses.dataclass(frozen=True, kw_only=True)
class ORPOConfig:
    """Odds-ratio preference optimisation: `lam` weighs the odds-ratio term against the NLL."""

    lam: float = 0.1

    def __post_init__(self) -> None:
        check(self.lam >= 0, "ORPOConfig", "lam", self.lam, "a float >= 0")


class ORPOLoss(NamedTuple):
    """The two ORPO terms as (sum, count), so accumulation over micro-batches stays exact."""

    nll: MaskedSum  # summed NLL over all chosen targets / number of chosen targets
    odds_ratio: MaskedSum  # summed −log σ(log odds ratio) / number of pairs

    def total(self, lam: float) -> jax.Array:
        """L_SFT + λ · L_OR on this batch."""
        return self.nll.mean + lam * self.odds_ratio.mean


class ORPOMetrics(NamedTuple):
    """Means over the valid pairs of a batch."""

    log_odds_ratio: jax.Array  # log σ(log odds(chosen) − log odds(rejected))
    log_odds_chosen: jax.Array  # log odds(chosen) − log odds(rejected)
    logps_chosen: jax.Array  # length-normalised
    logps_rejected: jax.Array


def _log_one_minus_exp(x: jax.Array) -> jax.Array:
    """log(1 − exp(x)) for x < 0, accurate on both sides of −log 2 (Mächler, 2012)."""
    return jnp.where(x > -jnp.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def orpo_loss(policy: PairLogprobs) -> tuple[ORPOLoss, ORPOMetrics]:
    """ORPO's NLL and odds-ratio terms; `ORPOLoss.total(ORPOConfig.lam)` combines them.

    `policy` holds *summed* log-probs and counts (`preference_pairs(..., average=False)`): the
    NLL is a per-token mean over all chosen targets, the odds use per-token average log-probs.
    """
    mask = policy.mask
    # Padding pairs get a harmless −1 so no NaN reaches the gradient through jnp.where.
    chosen = jnp.where(mask, policy.chosen / jnp.maximum(policy.chosen_count, 1.0), -1.0)
    rejected = jnp.where(mask, policy.rejected / jnp.maximum(policy.rejected_count, 1.0), -1.0)
    chosen = jnp.minimum(chosen, _MAX_NORMALISED_LOGP)
    rejected = jnp.minimum(rejected, _MAX_NORMALISED_LOGP)
    log_odds = (chosen - _log_one_minus_exp(chosen)) - (rejected - _log_one_minus_exp(rejected))
    ratio = jax.nn.log_sigmoid(log_odds)
    loss = ORPOLoss(
        nll=MaskedSum(
            total=-jnp.sum(jnp.where(mask, policy.chosen, 0.0)),
            count=jnp.sum(jnp.where(mask, policy.chosen_count, 0.0)),
        ),
        odds_ratio=MaskedSum(
            total=-jnp.sum(jnp.where(mask, ratio, 0.0)), count=jnp.sum(mask).astype(jnp.float32)
        ),
    )
    metrics = ORPOMetrics(
        log_odds_ratio=_masked_mean(ratio, mask),
        log_odds_chosen=_masked_mean(log_odds, mask),
        logps_chosen=_masked_mean(chosen, mask),
        logps_rejected=_masked_mean(rejected, mask),
    )
    return loss, metrics
