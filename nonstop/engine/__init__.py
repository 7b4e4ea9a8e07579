"""Inference: KV cache, on-device sampling, a continuous-batching scheduler and its async API.

    from nonstop.engine import Engine, SamplingParams
    with Engine(model, EngineConfig(max_slots=16, max_len=1024)) as engine:
        completion = await engine.generate(token_ids, SamplingParams(max_tokens=64))

Every engine (this one, `VLLMEngine`, `RemoteEngine`) follows the rollout protocol in
`protocol.py`. `VLLMEngine` is imported on first use, so importing nonstop never imports vLLM.
"""

from nonstop.engine.config import EngineConfig
from nonstop.engine.engine import Engine, EngineStats, gc_heap_frozen
from nonstop.engine.protocol import (
    RolloutClient,
    RolloutEngine,
    RolloutLimits,
    RolloutSession,
    RolloutStats,
    ServingEngine,
)
from nonstop.engine.remote import RemoteEngine, RemoteEngineError, RemoteRequestError
from nonstop.engine.requests import Detokenizer, Session
from nonstop.engine.sampling import SamplingParams
from nonstop.engine.types import Completion, EngineError, FinishReason, RequestError

__all__ = [
    "Completion",
    "Detokenizer",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "FinishReason",
    "RemoteEngine",
    "RemoteEngineError",
    "RemoteRequestError",
    "RequestError",
    "RolloutClient",
    "RolloutEngine",
    "RolloutLimits",
    "RolloutSession",
    "RolloutStats",
    "SamplingParams",
    "ServingEngine",
    "Session",
    "VLLMEngine",
    "VLLMEngineConfig",
    "gc_heap_frozen",
]


def __getattr__(name: str) -> object:
    # vLLM (the `vllm` extra) is imported only when VLLMEngine is asked for.
    if name in ("VLLMEngine", "VLLMEngineConfig"):
        from nonstop.engine import vllm_engine

        return getattr(vllm_engine, name)
    raise AttributeError(f"module 'nonstop.engine' has no attribute {name!r}")
