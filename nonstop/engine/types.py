"""What the engine hands back: `Completion`, its `FinishReason`, and the engine's errors.

A completion is token in, token out: the sampled ids, the log-probability of each under the
weights that sampled it, and the policy version of those weights, so an RL learner can build a
trajectory (and its importance ratios) without re-tokenizing or re-scoring anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, get_args

FinishReason = Literal["stop", "length", "cache_full", "aborted"]
"""Why a completion ended:
- "stop": a stop token id (kept as the last token) or a stop string (the text of the tokens
  returned contains it; the token that completed it is the last one);
- "length": `max_tokens` tokens were generated;
- "cache_full": prompt + completion filled the engine's `max_len`;
- "aborted": the engine stopped before the request finished (the tokens so far are kept).
"""

FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)


class EngineError(RuntimeError):
    """The engine cannot serve a request: it is stopped, or a device step failed."""


class RequestError(EngineError, ValueError):
    """This request is invalid (prompt, token ids or sampling values); others are unaffected."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Completion:
    """One generation.

    `logprobs[i]` is log p(tokens[i]) under the full, unmodified softmax of the logits at
    temperature 1 of the weights that sampled it (version `policy_versions[i]`): no temperature,
    top-k or top-p applied, which is what RL importance ratios need. `sampling_logprobs[i]` is
    the log-probability under the distribution actually sampled from (after temperature, top-k
    and top-p; 0.0 for greedy). `num_prefilled` counts the prompt tokens this request ran
    through prefill; `num_cached` those it found already in its session's cache.
    """

    tokens: Sequence[int]
    logprobs: Sequence[float]
    finish_reason: FinishReason
    policy_versions: Sequence[int]
    sampling_logprobs: Sequence[float] = ()
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    num_prefilled: int = 0
    num_cached: int = 0
    first_token_s: float | None = None  # seconds from submission to the first sampled token

    def __post_init__(self) -> None:
        for name in ("tokens", "policy_versions"):
            object.__setattr__(self, name, tuple(map(int, getattr(self, name))))
        for name in ("logprobs", "sampling_logprobs"):
            object.__setattr__(self, name, tuple(map(float, getattr(self, name))))
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Completion.finish_reason: got {self.finish_reason!r}; "
                             f"valid: {FINISH_REASONS}")
        n = len(self.tokens)
        if len(self.logprobs) != n or len(self.policy_versions) != n:
            raise ValueError(f"Completion: {n} tokens but {len(self.logprobs)} logprobs and "
                             f"{len(self.policy_versions)} policy_versions; all must match")
        if self.sampling_logprobs and len(self.sampling_logprobs) != n:
            raise ValueError(f"Completion: {n} tokens but {len(self.sampling_logprobs)} "
                             "sampling_logprobs")


__all__ = ["FINISH_REASONS", "Completion", "EngineError", "FinishReason", "RequestError"]
