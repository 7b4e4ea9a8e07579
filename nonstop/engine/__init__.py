"""Inference: KV cache, on-device sampling, a continuous-batching scheduler and its async API.

    from nonstop.engine import Engine, SamplingParams
    with Engine(model, EngineConfig(max_slots=16, max_len=1024)) as engine:
        completion = await engine.generate(token_ids, SamplingParams(max_tokens=64))
"""

from nonstop.engine.config import EngineConfig
from nonstop.engine.engine import Engine, EngineStats, gc_heap_frozen
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
    "SamplingParams",
    "Session",
    "gc_heap_frozen",
]
