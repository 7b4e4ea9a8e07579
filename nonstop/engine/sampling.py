"""Sampling: `SamplingParams` per request, and the pure on-device sampler every step uses.

One compiled function serves every mix of requests: the sampler takes per-row arrays
(temperature, top-k, top-p, seed, token index) instead of Python values. Greedy rows
(temperature 0) take the argmax. Other rows draw with the Gumbel-max trick from the logits
scaled by 1/temperature, restricted to the top-k and then to the top-p nucleus (renormalised
over the top-k set, as transformers and vLLM do). The random key of a row is
fold_in(key(seed), token index), so each request has its own stream: the samples of a GRPO group
(different seeds) differ, and a seeded request gives the same tokens whatever else is batched.

Each sampled token also gets two log-probabilities:
- `logprob`: under the full softmax of the raw logits at temperature 1 (the policy's own
  probability, which RL importance ratios need);
- `sampling_logprob`: under the distribution actually sampled from (0.0 for greedy rows).
The sort that top-k/top-p need runs only when some row in the step asks for them (`lax.cond`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import Array

from nonstop.engine.types import RequestError
from nonstop.models.validation import check

_SEED_MOD = 2**32


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature: 0 is greedy; > 0 scales the logits by 1/temperature.
    top_k: keep the k most likely tokens (0: off). top_p: keep the smallest set of most likely
    tokens whose probability reaches top_p (1.0: off).
    max_tokens: stop after this many tokens ("length"); None: until a stop or the cache is full.
    stop_token_ids: stop after sampling one of these (it is returned); the engine adds no
    end-of-sequence ids of its own, so pass the tokenizer's here.
    stop: stop strings, matched in the decoded completion (needs an engine tokenizer).
    seed: the request's random stream (reduced modulo 2**32); None draws a fresh one.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        owner = "SamplingParams"
        t = self.temperature
        check(not isinstance(t, bool) and isinstance(t, int | float) and math.isfinite(t)
              and t >= 0, owner, "temperature", t, "a finite float >= 0 (0 is greedy)",
              RequestError)
        check(not isinstance(self.top_k, bool) and isinstance(self.top_k, int) and self.top_k >= 0,
              owner, "top_k", self.top_k, "an int >= 0 (0 turns it off)", RequestError)
        p = self.top_p
        check(not isinstance(p, bool) and isinstance(p, int | float) and 0 < p <= 1, owner,
              "top_p", p, "a float in (0, 1]", RequestError)
        m = self.max_tokens
        check(m is None or (not isinstance(m, bool) and isinstance(m, int) and m >= 1), owner,
              "max_tokens", m, "an int >= 1 or null", RequestError)
        check(all(not isinstance(tok, bool) and isinstance(tok, int) and tok >= 0
                  for tok in self.stop_token_ids), owner, "stop_token_ids", self.stop_token_ids,
              "ints >= 0", RequestError)
        check(all(isinstance(s, str) and s for s in self.stop), owner, "stop", self.stop,
              "non-empty strings", RequestError)
        check(self.seed is None or (not isinstance(self.seed, bool) and isinstance(self.seed, int)),
              owner, "seed", self.seed, "an int or null", RequestError)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def seed32(seed: int) -> int:
    """A request seed reduced to the uint32 the device key is built from."""
    return seed % _SEED_MOD


def filter_logits(scaled: Array, top_k: Array, top_p: Array) -> Array:
    """Mask scaled logits [S, V] outside each row's top-k, then outside its top-p nucleus.

    top_k int32[S] (0: off), top_p float32[S] (1.0: off). Ties with the last kept value are kept.
    Rows keep at least their most likely token.
    """
    V = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    rank = jnp.arange(V)[None, :]
    in_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    masked = jnp.where(in_k, ordered, -jnp.inf)
    probs = jax.nn.softmax(masked, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & ((mass_before < top_p[:, None]) | (rank == 0))
    n_keep = jnp.sum(keep, axis=-1)
    threshold = jnp.take_along_axis(ordered, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def row_keys(seeds: Array, steps: Array) -> Array:
    """One PRNG key per row from its request seed uint32[S] and token index int32[S]."""
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, steps)


def sample(logits: Array, temperature: Array, top_k: Array, top_p: Array, seeds: Array,
           steps: Array) -> tuple[Array, Array, Array]:
    """Sample one token per row of float32 logits [S, V].

    Returns (tokens int32[S], logprobs float32[S] under the raw softmax at temperature 1,
    sampling_logprobs float32[S] under the distribution sampled from, 0 for greedy rows).
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    wants_filter = jnp.any(~greedy & ((top_k > 0) | (top_p < 1.0)))
    filtered = jax.lax.cond(wants_filter, filter_logits, lambda x, k, p: x, scaled, top_k, top_p)

    def draw(filtered: Array) -> Array:
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],)))(
            row_keys(seeds, steps))
        return jnp.argmax(filtered + noise, axis=-1).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.all(greedy), lambda f: argmax, draw, filtered)
    tokens = jnp.where(greedy, argmax, drawn)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None],
                                   axis=-1)[:, 0]
    sampled_lp = jnp.take_along_axis(jax.nn.log_softmax(filtered, axis=-1), tokens[:, None],
                                     axis=-1)[:, 0]
    return tokens, logprobs, jnp.where(greedy, 0.0, sampled_lp)


def check_stop_ids(stop_token_ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"SamplingParams.stop_token_ids: {bad} are outside the vocabulary "
                           f"[0, {vocab_size})")


__all__ = ["SamplingParams", "filter_logits", "row_keys", "sample", "seed32"]
