"""The `TrainBatch` every trainer consumes, and its next-token loss-mask convention.

A batch is `B` rows of a fixed length `T` drawn from a few length buckets, so a jitted step
compiles once per bucket and never again. Each row holds one or more packed sequences:

- `tokens: int32[B,T]` — token ids, 0 in padding.
- `positions: int32[B,T]` — position within its own sequence, restarting at 0 for each packed
  sequence (0 in padding).
- `segment_ids: int32[B,T]` — 0 = padding, 1..M numbers the packed sequences of a row from left
  to right. Attention never crosses segments.
- `loss_mask: bool[B,T]` — see the convention below.
- optional per-token float32[B,T] arrays for RL (`advantages`, `behavior_logprobs`,
  `ref_logprobs`, `old_logprobs`), `None` when a trainer does not use them.

Loss-mask convention (next-token prediction). `loss_mask[b, t]` is True when token `t` is a
*target*: it is predicted from position `t - 1` of the same segment and its loss counts. Every
per-token array is aligned with `tokens`, never shifted: `behavior_logprobs[b, t]` is the
log-probability of `tokens[b, t]` given the tokens before it. The loss therefore compares
`logits[:, :-1]` with `tokens[:, 1:]` under `loss_mask[:, 1:]`, and a target is only valid when
its predecessor lies in the same segment — the first token of a sequence (and so the boundary
between two packed sequences) is never predicted. `target_mask` applies that check, so a loss
stays correct even if a producer sets `loss_mask` on a segment's first token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainBatch:
    """Packed rows of token ids with per-token masks; a pytree of host or device arrays."""

    tokens: Array  # int32[B,T]
    positions: Array  # int32[B,T]
    segment_ids: Array  # int32[B,T]
    loss_mask: Array  # bool[B,T]
    advantages: Array | None = None  # float32[B,T]
    behavior_logprobs: Array | None = None  # float32[B,T]
    ref_logprobs: Array | None = None  # float32[B,T]
    old_logprobs: Array | None = None  # float32[B,T]

    def __post_init__(self) -> None:
        if not hasattr(self.tokens, "shape"):
            return  # pytree utilities rebuild batches with non-array leaves (specs, shardings)
        shape = tuple(self.tokens.shape)
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and hasattr(value, "shape") and tuple(value.shape) != shape:
                raise ValueError(
                    f"TrainBatch.{field.name} has shape {tuple(value.shape)}, but every field "
                    f"must match tokens' shape {shape} ([B,T])"
                )

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T) of every field."""
        batch, length = self.tokens.shape
        return int(batch), int(length)


def target_mask(loss_mask: Array, segment_ids: Array) -> jax.Array:
    """bool[B,T]: True where token t is a valid next-token target (see the module docstring).

    Column 0 is always False (nothing precedes it); elsewhere the token must be in the loss mask,
    in a real segment (not padding), and in the same segment as token t - 1.
    """
    loss_mask = jnp.asarray(loss_mask, dtype=bool)
    segment_ids = jnp.asarray(segment_ids)
    same_segment = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    valid = loss_mask[:, 1:] & same_segment
    return jnp.pad(valid, ((0, 0), (1, 0)), constant_values=False)
