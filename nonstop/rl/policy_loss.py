"""The clipped policy-gradient loss of PPO, GRPO, Dr.GRPO, DAPO, GSPO and GSPO-token, with
off-policy correction against the log-probs of the weights that sampled each token.

Per loss token t with advantage A and importance ratio r against the "old" policy:

    loss_t = w_t * max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A)         (PPO, DAPO clip-higher)
    loss_t = min(loss_t, -dual_clip * A)  where A < 0                        (dual clip)
    loss_t += kl_coef * kl_t                                                 (KL as a loss term)

then aggregated over packed rows by `aggregation.aggregate`. The ratio r is

- `token`: exp(log pi(y_t) - log pi_old(y_t));
- `sequence` (GSPO): exp(mean over the sequence's loss tokens of the token log-ratios), the same
  value on every token of the sequence;
- `sequence_token` (GSPO-token): sg(sequence ratio) * pi(y_t) / sg(pi(y_t)) — the sequence
  ratio's value with each token's own gradient, so per-token advantages can be used; with
  per-sequence advantages its gradient equals GSPO's.

The off-policy weight w_t (`OffPolicyConfig`) corrects for staleness between the behaviour
policy (`behavior_logprobs`, from the engine) and the old policy:

- `none`: old = `old_logprobs` if given, else `behavior_logprobs`; w = 1.
- `decoupled` (Hilton et al. 2022; AReaL): old = the proximal policy (`old_logprobs`, required);
  w = min(pi_prox / pi_behav, weight_cap).
- `tis` (Yao et al. 2025): w = min(pi_old / pi_behav, weight_cap) with old = `old_logprobs`, or,
  when the learner does not recompute them, the current policy with its gradient stopped (the
  ratio is then 1 and clipping never binds: a one-update-per-batch learner).
- `sequence_mask` (MIS): w = 0 on every token of a sequence whose ratio pi_old / pi_behav
  (geometric mean or product over its loss tokens) lies outside [mask_low, mask_high], else 1;
  old as for `tis`.

Departures: truncation is upper-only (w never below the ratio), as in TIS; a masked sequence keeps
its place in the denominator (its tokens have weight 0), so denominators can be computed before
any forward pass and stay exact under accumulation; log-ratios are clamped to [-20, 20] before
`exp` (as verl does).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from nonstop.rl.aggregation import (
    LossTerms,
    aggregate,
    masked_mean,
    safe_divide,
    segment_mean,
    segment_sum,
    segment_token_counts,
    segments_to_tokens,
)
from nonstop.rl.config import OffPolicyConfig, PolicyLossConfig, RatioLevel
from nonstop.rl.kl import kl_estimate

LOG_RATIO_CLAMP = 20.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PolicyLossOutput:
    """The actor loss as summable `terms` (policy gradient plus KL term) and diagnostics.

    `metrics` are means over this batch's loss tokens (or sequences), for logging only.
    """

    terms: LossTerms
    metrics: dict[str, jax.Array]


def _masked_log_ratio(
    logprobs: jax.Array, other_logprobs: jax.Array, loss_mask: jax.Array
) -> jax.Array:
    log_ratio = jnp.where(loss_mask, logprobs - other_logprobs, 0.0).astype(jnp.float32)
    return jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def importance_ratio(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    loss_mask: jax.Array,
    segment_ids: jax.Array,
    *,
    level: RatioLevel,
    max_segments: int,
) -> jax.Array:
    """float32[B,T]: pi / pi_old per token, per sequence (GSPO) or GSPO-token; 1 off the mask."""
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, loss_mask)
    if level == "token":
        return jnp.exp(log_ratio)
    sequence_log_ratio = segments_to_tokens(
        segment_mean(log_ratio, loss_mask, segment_ids, max_segments), segment_ids
    )
    if level == "sequence":
        return jnp.where(loss_mask, jnp.exp(sequence_log_ratio), 1.0)
    if level == "sequence_token":
        masked_logprobs = jnp.where(loss_mask, logprobs, 0.0)
        token_grad = masked_logprobs - jax.lax.stop_gradient(masked_logprobs)
        log_ratio_st = jax.lax.stop_gradient(sequence_log_ratio) + token_grad
        return jnp.where(loss_mask, jnp.exp(jnp.where(loss_mask, log_ratio_st, 0.0)), 1.0)
    raise ValueError(f"ratio level {level!r} is not one of ('token', 'sequence', 'sequence_token')")


def clipped_surrogate(
    ratio: jax.Array,
    advantages: jax.Array,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(loss float32[B,T], clipped bool[B,T]): PPO's pessimistic clipped surrogate, negated.

    `clipped` marks tokens where a clipped branch (ratio clip or dual clip) set the loss, i.e.
    where the gradient through the ratio is zero.
    """
    advantages = advantages.astype(jnp.float32)
    unclipped = -advantages * ratio
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    ratio_clipped = -advantages * clipped_ratio
    loss = jnp.maximum(unclipped, ratio_clipped)
    clipped = ratio_clipped > unclipped
    if dual_clip is not None:
        dual = -advantages * dual_clip
        dual_binds = (advantages < 0) & (dual < loss)
        loss = jnp.where(dual_binds, dual, loss)
        clipped = clipped | dual_binds
    return loss, clipped


def behavior_weights(
    old_logprobs: jax.Array,
    behavior_logprobs: jax.Array,
    loss_mask: jax.Array,
    segment_ids: jax.Array,
    *,
    config: OffPolicyConfig,
    max_segments: int,
) -> jax.Array:
    """float32[B,T]: the off-policy weight w of each token (no gradient); 1 for `none`."""
    log_ratio = jax.lax.stop_gradient(_masked_log_ratio(old_logprobs, behavior_logprobs, loss_mask))
    if config.correction == "none":
        return jnp.ones_like(log_ratio)
    if config.correction in ("decoupled", "tis"):
        return jnp.exp(jnp.minimum(log_ratio, math.log(config.weight_cap)))
    if config.correction == "sequence_mask":
        if config.sequence_ratio == "product":
            per_sequence = segment_sum(log_ratio, segment_ids, max_segments)
        else:
            per_sequence = segment_mean(log_ratio, loss_mask, segment_ids, max_segments)
        low = math.log(config.mask_low) if config.mask_low > 0 else -math.inf
        keep = (per_sequence >= low) & (per_sequence <= math.log(config.mask_high))
        return segments_to_tokens(keep.astype(jnp.float32), segment_ids)
    raise ValueError(f"off-policy correction {config.correction!r} is not supported")


def _old_logprobs(
    logprobs: jax.Array,
    behavior_logprobs: jax.Array,
    old_logprobs: jax.Array | None,
    config: OffPolicyConfig,
) -> jax.Array:
    if old_logprobs is not None:
        return old_logprobs
    if config.correction == "none":
        return behavior_logprobs
    if config.correction == "decoupled":
        raise ValueError(
            "OffPolicyConfig.correction = 'decoupled' needs old_logprobs: the log-probs of the "
            "proximal policy recomputed by the learner"
        )
    return jax.lax.stop_gradient(logprobs)


def behavior_mismatch(
    logprobs: jax.Array, behavior_logprobs: jax.Array, loss_mask: jax.Array
) -> dict[str, jax.Array]:
    """How far the rollout engine's log-probs of the sampled tokens are from the trainer's
    (float32[B,T] each; no gradient): the mean and max of |behavior - trainer| over the loss
    tokens, and the k3 estimate of KL(behavior || trainer) from those samples,
    r - 1 - log r with r = pi_trainer / pi_behavior. With the trainer on the weights that
    sampled (staleness 0, the step's first pass) this is the backend's numerical mismatch
    (a different engine, kernels or dtype); otherwise it includes the policy's lag."""
    trainer = jax.lax.stop_gradient(logprobs)
    gap = jnp.where(loss_mask, jnp.abs(trainer - behavior_logprobs), 0.0)
    k3 = kl_estimate(behavior_logprobs, trainer, loss_mask, estimator="k3")
    return {
        "behavior_logprob_gap_mean": masked_mean(gap, loss_mask),
        "behavior_logprob_gap_max": jnp.max(gap),
        "behavior_kl_k3": masked_mean(k3, loss_mask),
    }


def policy_loss(
    logprobs: jax.Array,
    *,
    advantages: jax.Array,
    behavior_logprobs: jax.Array,
    loss_mask: jax.Array,
    segment_ids: jax.Array,
    config: PolicyLossConfig,
    max_segments: int,
    old_logprobs: jax.Array | None = None,
    ref_logprobs: jax.Array | None = None,
    denominator: jax.Array | None = None,
) -> PolicyLossOutput:
    """The actor loss of a packed batch: every array float32[B,T] except the masks.

    Per-token arrays are aligned with the tokens they score (see `nonstop.train.batch`), and
    `loss_mask` should be the valid-target mask (`train.batch.target_mask`).
    `logprobs` are the current policy's (differentiated); `max_segments` is the static M of the
    packing; `denominator` is the global one from `aggregation.aggregation_denominator` over the
    step's full batch when accumulating micro-batches (else computed over this batch).
    `ref_logprobs` are needed when `config.kl` is enabled in `loss` mode.
    """
    loss_mask = jnp.asarray(loss_mask, dtype=bool)
    off_policy = config.off_policy
    old = _old_logprobs(logprobs, behavior_logprobs, old_logprobs, off_policy)
    ratio = importance_ratio(
        logprobs, old, loss_mask, segment_ids, level=config.ratio_level, max_segments=max_segments
    )
    surrogate, clipped = clipped_surrogate(
        ratio,
        advantages,
        clip_eps_low=config.clip_eps_low,
        clip_eps_high=config.clip_eps_high,
        dual_clip=config.dual_clip,
    )
    weights = behavior_weights(
        old, behavior_logprobs, loss_mask, segment_ids, config=off_policy, max_segments=max_segments
    )
    pg_per_token = weights * surrogate

    def aggregated(per_token: jax.Array) -> LossTerms:
        return aggregate(
            per_token,
            loss_mask,
            segment_ids,
            mode=config.aggregation,
            max_segments=max_segments,
            max_len_norm=config.max_len_norm,
            denominator=denominator,
        )

    pg_terms = aggregated(pg_per_token)
    metrics = {
        "pg_loss": pg_terms.value(),
        "clip_fraction": masked_mean(clipped.astype(jnp.float32), loss_mask),
        "ratio_mean": masked_mean(ratio, loss_mask),
        "importance_weight_mean": masked_mean(weights, loss_mask),
        **behavior_mismatch(logprobs, behavior_logprobs, loss_mask),
    }
    if off_policy.correction == "sequence_mask":
        present = segment_token_counts(loss_mask, segment_ids, max_segments) > 0
        dropped = present & (segment_sum(weights, segment_ids, max_segments) == 0)
        metrics["masked_sequence_fraction"] = safe_divide(
            jnp.sum(dropped.astype(jnp.float32)), jnp.sum(present.astype(jnp.float32))
        )

    terms = pg_terms
    if config.kl.enabled and config.kl.mode == "loss":
        if ref_logprobs is None:
            raise ValueError(
                f"PolicyLossConfig.kl has coef={config.kl.coef} in 'loss' mode, which needs "
                "ref_logprobs"
            )
        kl = kl_estimate(logprobs, ref_logprobs, loss_mask, estimator=config.kl.estimator)
        kl_terms = aggregated(config.kl.coef * kl)
        terms = LossTerms(pg_terms.numerator + kl_terms.numerator, pg_terms.denominator)
        metrics["kl"] = masked_mean(kl, loss_mask)
        metrics["kl_loss"] = kl_terms.value()
    metrics["loss"] = terms.value()
    return PolicyLossOutput(terms=terms, metrics=metrics)
