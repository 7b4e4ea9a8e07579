"""Loss functions of the supervised trainer, and the frozen reference policy of DPO.

Each `*_loss_fn` has the `nonstop.train.make_train_step` signature
`loss_fn(model, batch, rng) -> (numerator, denominator, aux)`:
- SFT: summed token NLL over target tokens / number of target tokens.
- DPO: summed pair losses / number of pairs, reference log-probs from the batch
  (`ref_logprobs`, precomputed), from the reference model (on the fly), or none
  (reference-free). IPO uses per-token averaged log-probs, as in its paper and TRL.
- ORPO: NLL of the chosen responses plus λ times the odds-ratio term.

The reference policy is never a second trained model:
- under LoRA it is the policy itself with every adapter zeroed (`zeroed_adapters`): the base
  weights are shared, no copy is made;
- for full fine-tuning with on-the-fly reference log-probs, `PolicyWithReference` holds the policy
  and a frozen copy of the starting weights side by side (the trainer trains only the `policy`
  path; the copy lives in the train state's frozen part and is never checkpointed);
- with precomputed log-probs (`nonstop.sft.reference`) no reference weights exist during training.

Departure: with gradient accumulation, ORPO's two terms have different denominators (chosen
tokens and pairs); the step divides once by the chosen-token count, so the odds-ratio term is
weighted by each micro-batch's tokens-per-pair. With one micro-batch it is exactly
`L_SFT + λ·L_OR`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nonstop.models.lora import reseeded
from nonstop.sft.losses import (
    DPOConfig,
    ORPOConfig,
    PairLogprobs,
    dpo_loss,
    masked_cross_entropy,
    orpo_loss,
    preference_pairs,
    sequence_logprobs,
)
from nonstop.train.batch import TrainBatch
from nonstop.train.logprobs import token_logprobs
from nonstop.train.step import LossFn, Metrics

POLICY = "policy"


class PolicyWithReference(nnx.Module):
    """A policy and a frozen copy of its starting weights (full fine-tuning, on-the-fly DPO)."""

    def __init__(self, policy: nnx.Module):
        self.policy = policy
        self.reference = nnx.clone(policy)


def policy_of(model: nnx.Module) -> nnx.Module:
    """The trained model inside `model` (itself unless it is a `PolicyWithReference`)."""
    return model.policy if isinstance(model, PolicyWithReference) else model


def reference_of(model: nnx.Module) -> nnx.Module:
    """The frozen reference: the stored copy, or the policy with its LoRA adapters zeroed."""
    if isinstance(model, PolicyWithReference):
        return model.reference
    return zeroed_adapters(model)


def zeroed_adapters(model: nnx.Module) -> nnx.Module:
    """`model` with every `nnx.LoRAParam` set to zeros: the base model, sharing its weights."""
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    if not jax.tree.leaves(adapters):
        raise ValueError(
            "the reference policy is the base model with LoRA adapters zeroed, but this model "
            "has no adapters; full fine-tuning needs PolicyWithReference (a frozen copy)"
        )
    return nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, adapters), rest)


def forward_logprobs(model: nnx.Module, batch: TrainBatch) -> jax.Array:
    """float32[B,T] log-probabilities of the batch's tokens (aligned with tokens)."""
    logits, _ = model(batch.tokens, batch.positions, batch.segment_ids)
    return token_logprobs(logits, batch.tokens)


def _reseed(model: nnx.Module, rng: jax.Array, dropout: bool) -> nnx.Module:
    """The model to run: with `dropout`, a copy whose LoRA dropout is reseeded from `rng`."""
    return reseeded(model, rng) if dropout else model


def sft_loss_fn(*, dropout: bool = False) -> LossFn:
    """Token-level NLL over the batch's targets."""

    def loss_fn(model: nnx.Module, batch: TrainBatch, rng: jax.Array):
        policy = policy_of(model)
        policy = _reseed(policy, rng, dropout)
        logits, _ = policy(batch.tokens, batch.positions, batch.segment_ids)
        nll = masked_cross_entropy(logits, batch.tokens, batch.loss_mask, batch.segment_ids)
        return nll.total, nll.count, {}

    return loss_fn


def _pairs(logprobs: jax.Array, batch: TrainBatch, num_segments: int, average: bool
           ) -> PairLogprobs:
    sequences = sequence_logprobs(logprobs, batch.loss_mask, batch.segment_ids, num_segments)
    return preference_pairs(sequences, average=average)


def dpo_loss_fn(
    config: DPOConfig,
    *,
    reference: str,
    num_segments: int,
    dropout: bool = False,
) -> LossFn:
    """DPO / IPO / hinge over packed (chosen, rejected) pairs.

    `reference`: "precomputed" reads `batch.ref_logprobs`; "on_the_fly" runs `reference_of(model)`
    under `stop_gradient`; ignored when `config.reference_free`.
    """
    average = config.loss_type == "ipo"

    def loss_fn(model: nnx.Module, batch: TrainBatch, rng: jax.Array):
        policy = policy_of(model)
        policy = _reseed(policy, rng, dropout)
        pairs = _pairs(forward_logprobs(policy, batch), batch, num_segments, average)
        ref_pairs = None
        if not config.reference_free:
            if reference == "precomputed":
                if batch.ref_logprobs is None:
                    raise ValueError("DPO with reference='precomputed' needs batch.ref_logprobs")
                ref_logprobs = batch.ref_logprobs
            else:
                ref_logprobs = jax.lax.stop_gradient(forward_logprobs(reference_of(model), batch))
            ref_pairs = _pairs(ref_logprobs, batch, num_segments, average)
        loss, metrics = dpo_loss(pairs, ref_pairs, config)
        return loss.total, loss.count, dict(metrics._asdict())

    return loss_fn


def orpo_loss_fn(config: ORPOConfig, *, num_segments: int, dropout: bool = False) -> LossFn:
    """ORPO: chosen-response NLL plus `config.lam` times the odds-ratio loss."""

    def loss_fn(model: nnx.Module, batch: TrainBatch, rng: jax.Array):
        policy = policy_of(model)
        policy = _reseed(policy, rng, dropout)
        pairs = _pairs(forward_logprobs(policy, batch), batch, num_segments, average=False)
        loss, metrics = orpo_loss(pairs)
        nll, odds = loss.nll, loss.odds_ratio
        tokens_per_pair = nll.count / jnp.maximum(odds.count, 1.0)
        numerator = nll.total + config.lam * odds.total * tokens_per_pair
        aux: Metrics = {"nll": nll.mean, "odds_ratio_loss": odds.mean, **metrics._asdict()}
        return numerator, nll.count, aux

    return loss_fn
