"""The Trajectory contract: one episode, token in and token out (docs/architecture.md).

Generated text is never re-tokenized: `tokens` is exactly the context the engine saw, prompt and
tool/environment turns included, and `loss_mask` is true exactly on the tokens the policy
sampled, with their behaviour log-probabilities and the policy version that sampled each one.
Single-turn RL (prompt + completion) is the one-turn case of the same structure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np


class TrajectoryError(ValueError):
    """A trajectory's arrays disagree with each other or with the contract."""


@dataclasses.dataclass(kw_only=True)
class Trajectory:
    """One episode. Arrays are [T]; `reward` is set once the episode is scored."""

    tokens: np.ndarray  # int32[T]
    loss_mask: np.ndarray  # bool[T]
    behavior_logprobs: np.ndarray  # float32[T], 0 where the mask is false
    policy_version: np.ndarray  # int32[T], -1 where the mask is false
    group_id: int
    episode_id: int
    prompt_length: int = 0
    reward: float | None = None
    advantage: float | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, np.int32)
        self.loss_mask = np.asarray(self.loss_mask, bool)
        self.behavior_logprobs = np.asarray(self.behavior_logprobs, np.float32)
        self.policy_version = np.asarray(self.policy_version, np.int32)
        n = self.tokens.shape
        for name in ("loss_mask", "behavior_logprobs", "policy_version"):
            if getattr(self, name).shape != n:
                raise TrajectoryError(f"episode {self.episode_id}: {name} has shape "
                                      f"{getattr(self, name).shape}, tokens have {n}")
        if np.any(self.policy_version[self.loss_mask] < 0):
            raise TrajectoryError(f"episode {self.episode_id}: a sampled token has no policy "
                                  "version")

    @classmethod
    def from_completion(cls, prompt: Sequence[int], completion: Sequence[int],
                        logprobs: Sequence[float], versions: Sequence[int], *, group_id: int,
                        episode_id: int, **info: Any) -> Trajectory:
        """A single-turn episode: the prompt (not trained) followed by the sampled completion."""
        p, c = len(prompt), len(completion)
        return cls(
            tokens=np.concatenate([np.asarray(prompt, np.int32), np.asarray(completion, np.int32)]),
            loss_mask=np.concatenate([np.zeros(p, bool), np.ones(c, bool)]),
            behavior_logprobs=np.concatenate([np.zeros(p, np.float32),
                                              np.asarray(logprobs, np.float32)]),
            policy_version=np.concatenate([np.full(p, -1, np.int32),
                                           np.asarray(versions, np.int32)]),
            group_id=group_id, episode_id=episode_id, prompt_length=p, info=dict(info))

    def append(self, tokens: Sequence[int], *, sampled: bool,
               logprobs: Sequence[float] | None = None,
               versions: Sequence[int] | None = None) -> None:
        """Append a model turn (`sampled=True`, with logprobs and versions) or an observation."""
        n = len(tokens)
        if sampled and (logprobs is None or versions is None or len(logprobs) != n
                        or len(versions) != n):
            raise TrajectoryError(f"episode {self.episode_id}: a sampled turn of {n} tokens "
                                  "needs one logprob and one policy version per token")
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, np.int32)])
        self.loss_mask = np.concatenate([self.loss_mask, np.full(n, sampled, bool)])
        self.behavior_logprobs = np.concatenate([
            self.behavior_logprobs,
            np.asarray(logprobs, np.float32) if sampled else np.zeros(n, np.float32)])
        self.policy_version = np.concatenate([
            self.policy_version,
            np.asarray(versions, np.int32) if sampled else np.full(n, -1, np.int32)])

    @property
    def num_sampled(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def min_version(self) -> int:
        """The oldest policy version that sampled any token (-1 if nothing was sampled)."""
        sampled = self.policy_version[self.loss_mask]
        return int(sampled.min()) if sampled.size else -1

    def __len__(self) -> int:
        return int(self.tokens.shape[0])
