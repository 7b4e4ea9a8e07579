"""`EngineConfig`: the size of the KV cache, the prefill chunk buckets, and the scheduler policy."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from nonstop.engine.types import EngineError

WeightUpdateMode = Literal["continue", "abort"]
CacheDtype = Literal["float32", "bfloat16"]


class EngineConfigError(EngineError, ValueError):
    """An `EngineConfig` field has a value the engine cannot use."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine is sized and scheduled.

    max_slots: sequences decoded together (S); the KV cache is max_slots x max_len.
    max_len: positions per slot; prompt + completion never exceed it ("cache_full").
    prefill_chunks: the chunk lengths prefill is compiled for (one compilation each). A prompt
    is cut into chunks of the largest size, and its tail is padded to the smallest size that
    holds it. Sizes above max_len are clipped to max_len.
    prefill_budget: prompt tokens prefilled between two decode steps while sequences are
    decoding (at least one chunk); more gives faster time-to-first-token, fewer slower decode.
    cache_dtype: the KV cache's dtype; None: the model's compute dtype.
    on_weight_update: "continue" keeps in-flight sequences going on the new weights (each token
    records its policy version); "abort" restarts them on the new weights.
    seed: the engine's stream of seeds for requests that bring none.
    """

    max_slots: int = 8
    max_len: int = 1024
    prefill_chunks: tuple[int, ...] = (16, 64, 256)
    prefill_budget: int = 256
    cache_dtype: CacheDtype | None = None
    on_weight_update: WeightUpdateMode = "continue"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_slots", "prefill_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineConfigError(f"EngineConfig.{name}: got {value!r}; valid: an int >= 1")
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len < 2:
            raise EngineConfigError(f"EngineConfig.max_len: got {self.max_len!r}; valid: an int "
                                    ">= 2 (a prompt token and a generated one)")
        chunks = tuple(self.prefill_chunks)
        if not chunks or any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                             for c in chunks):
            raise EngineConfigError(f"EngineConfig.prefill_chunks: got {self.prefill_chunks!r}; "
                                    "valid: a non-empty tuple of ints >= 1")
        object.__setattr__(self, "prefill_chunks", chunks)
        if self.cache_dtype is not None and self.cache_dtype not in get_args(CacheDtype):
            raise EngineConfigError(f"EngineConfig.cache_dtype: got {self.cache_dtype!r}; "
                                    f"valid: None or one of {get_args(CacheDtype)}")
        if self.on_weight_update not in get_args(WeightUpdateMode):
            raise EngineConfigError(f"EngineConfig.on_weight_update: got "
                                    f"{self.on_weight_update!r}; valid: "
                                    f"{get_args(WeightUpdateMode)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise EngineConfigError(f"EngineConfig.seed: got {self.seed!r}; valid: an int")

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """The distinct prefill chunk lengths actually compiled, ascending."""
        return tuple(sorted({min(c, self.max_len) for c in self.prefill_chunks}))

    def chunk_for(self, remaining: int) -> int:
        """The chunk length for a prompt tail of `remaining` tokens."""
        sizes = self.chunk_sizes
        for size in sizes:
            if size >= remaining:
                return size
        return sizes[-1]


__all__ = ["CacheDtype", "EngineConfig", "EngineConfigError", "WeightUpdateMode"]
