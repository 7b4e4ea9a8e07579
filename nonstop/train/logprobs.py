"""Per-token log-probabilities of the tokens in a batch, aligned with `tokens`.

`token_logprobs(logits, tokens)[b, t]` is log p(tokens[b, t] | tokens[b, :t]) read from the
logits the model produced at position t - 1, following the convention in `nonstop.train.batch`:
column 0 has no predecessor and is 0. Segment boundaries are not checked here; combine the result
with `target_mask(loss_mask, segment_ids)` before summing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """float32[B,T] log-probabilities of `tokens` (int32[B,T]) under `logits` (float[B,T,V])."""
    if logits.ndim != 3 or tokens.ndim != 2 or logits.shape[:2] != tokens.shape:
        raise ValueError(
            f"token_logprobs expects logits [B,T,V] and tokens [B,T] with the same B and T; "
            f"got logits {logits.shape} and tokens {tokens.shape}"
        )
    # optax's fused log-softmax + gather avoids materialising a float32 [B,T,V] log-softmax.
    nll = optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), tokens[:, 1:].astype(jnp.int32)
    )
    return jnp.pad(-nll, ((0, 0), (1, 0)))
