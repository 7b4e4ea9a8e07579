"""`VLLMEngine`'s value types: its config, its stats and its session handle.

Like `vllm_engine.py`, this module imports no vLLM, so a `VLLMEngineConfig` can be built
and checked without the `vllm` extra.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from nonstop.models.validation import check, check_choice, check_int

VLLMDtype = Literal["float32", "bfloat16", "float16"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class VLLMEngineConfig:
    """How big the vLLM engine is and how it runs.

    max_slots: sequences decoded together (vLLM's max_num_seqs). max_len: prompt plus
    completion per request (max_model_len). dtype: the weights' and activations' dtype in vLLM
    (None: the model's parameter dtype). kv_cache_gib: memory for the KV cache (vLLM's
    kv_cache_memory_bytes). block_size: tokens per KV block, the prefix cache's granularity
    (vLLM's CPU attention needs a multiple of 32; None: vLLM's default for the platform).
    on_weight_update: only "abort" (see `vllm_engine`'s docstring).
    enforce_eager: no torch.compile or CUDA graphs (a much faster start; slower steps).
    seed: the stream of seeds for requests that bring none. weight_chunk_mib: the largest
    message of a weight update. startup_timeout_s: how long `start()` waits for vLLM.
    """

    max_slots: int = 8
    max_len: int = 1024
    dtype: VLLMDtype | None = None
    kv_cache_gib: float = 1.0
    block_size: int | None = 32
    on_weight_update: Literal["abort"] = "abort"
    enforce_eager: bool = True
    seed: int = 0
    weight_chunk_mib: int = 256
    startup_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        owner = "VLLMEngineConfig"
        check_int(owner, "max_slots", self.max_slots)
        check_int(owner, "max_len", self.max_len, low=2)
        check_int(owner, "weight_chunk_mib", self.weight_chunk_mib)
        if self.block_size is not None:
            check_int(owner, "block_size", self.block_size)
        if self.dtype is not None:
            check_choice(owner, "dtype", self.dtype, VLLMDtype)
        check(
            isinstance(self.kv_cache_gib, int | float) and self.kv_cache_gib > 0,
            owner,
            "kv_cache_gib",
            self.kv_cache_gib,
            "a number > 0",
        )
        check(
            self.on_weight_update == "abort",
            owner,
            "on_weight_update",
            self.on_weight_update,
            "'abort' (requests in flight are resubmitted with their "
            "generated prefix; vLLM's pause-and-keep cannot tag versions exactly)",
        )
        check(
            isinstance(self.seed, int) and not isinstance(self.seed, bool),
            owner,
            "seed",
            self.seed,
            "an int",
        )
        check(
            self.startup_timeout_s > 0,
            owner,
            "startup_timeout_s",
            self.startup_timeout_s,
            "a number > 0",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class VLLMEngineStats:
    """Totals since start, counted by this client (vLLM's own metrics are not read)."""

    prefilled_tokens: int  # prompt tokens vLLM computed (not found in its prefix cache)
    generated_tokens: int
    completed: int
    restarted: int  # requests aborted by a weight update and resubmitted with their prefix
    prefix_hit_tokens: int
    waiting: int  # submitted, not yet handed to vLLM (e.g. during a weight update)
    active_slots: int  # requests inside vLLM
    cached_tokens: int  # not known from outside vLLM: 0
    weight_updates: int
    weight_sync_s: float  # seconds spent in update_weights, conversion and transfer included
    policy_version: int


class VLLMSession:
    """A multi-turn episode's handle. vLLM keeps no state per session: its later turns are
    prefix-cache hits. Closing it makes further turns an error, as with `Engine`'s."""

    def __init__(self, session_id: int) -> None:
        self.id = session_id
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> VLLMSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VLLMSession(id={self.id}, closed={self.closed})"


__all__ = ["VLLMDtype", "VLLMEngineConfig", "VLLMEngineStats", "VLLMSession"]
