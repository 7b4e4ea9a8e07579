"""`Scorer`: log-probabilities of a whole token sequence under the model, by one full forward.

What the server's `echo` (prompt log-probs) and `top_logprobs` read: for every position t >= 1,
log p(tokens[t] | tokens[:t]) and the `MAX_TOP` most likely tokens there with their
log-probabilities, all from the full, unmodified softmax at temperature 1 (the same distribution
the engine's `Completion.logprobs` come from). Sequences are padded to a power of two (at least
16, at most `max_len`), so each length bucket compiles once, on first use.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nonstop.models import Decoder

MAX_TOP = 20
_MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Scores:
    """Per position t of a sequence: `logprobs[t]` = log p(tokens[t] | tokens[:t]) and the top
    `MAX_TOP` alternatives (`top_ids[t]`, `top_logprobs[t]`, most likely first). Row 0 has no
    predecessor: its logprob is 0 and its alternatives are meaningless."""

    logprobs: np.ndarray  # float32[T]
    top_ids: np.ndarray  # int32[T, MAX_TOP]
    top_logprobs: np.ndarray  # float32[T, MAX_TOP]


class Scorer:
    """Scores sequences of up to `max_len` tokens with the weights `model` has when the scorer
    is built (it keeps those arrays; a later weight update of an engine does not reach it)."""

    def __init__(self, model: Decoder, max_len: int):
        self.max_len = max_len
        graphdef, state = nnx.split(model)
        self._state = state
        self._lock = threading.Lock()  # one compile per bucket even under concurrent first use
        k = min(MAX_TOP, model.cfg.vocab_size)

        @jax.jit
        def score(state: nnx.State, tokens: jax.Array) -> tuple[jax.Array, ...]:
            logits, _ = nnx.merge(graphdef, state)(tokens[None])
            logp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)  # [T, V]
            prev = jnp.concatenate([logp[:1], logp[:-1]])  # row t: the prediction of token t
            chosen = jnp.take_along_axis(prev, tokens[:, None], axis=-1)[:, 0]
            top_lp, top_ids = jax.lax.top_k(prev, k)
            return chosen.at[0].set(0.0), top_ids, top_lp

        self._score = score

    def bucket(self, n: int) -> int:
        size = _MIN_BUCKET
        while size < n:
            size *= 2
        return min(size, self.max_len)

    def score(self, tokens: Sequence[int]) -> Scores:
        """Scores of `tokens` (1 <= len <= max_len); blocking: call it off the event loop."""
        n = len(tokens)
        if not 1 <= n <= self.max_len:
            raise ValueError(f"Scorer.score: {n} tokens; valid: 1 to max_len={self.max_len}")
        padded = np.zeros(self.bucket(n), np.int32)
        padded[:n] = tokens
        with self._lock:
            out = self._score(self._state, jnp.asarray(padded))
        chosen, top_ids, top_lp = jax.device_get(out)
        return Scores(logprobs=np.asarray(chosen[:n]), top_ids=np.asarray(top_ids[:n]),
                      top_logprobs=np.asarray(top_lp[:n]))


__all__ = ["MAX_TOP", "Scorer", "Scores"]
