"""`RemoteEngine`'s value types: its limits, its stats and its session handle."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from nonstop.engine.types import EngineError

if TYPE_CHECKING:
    from nonstop.engine.remote import RemoteEngine


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteLimits:
    """`RemoteEngine.config`: the context per request and the concurrency of all servers (as
    given, else as the servers report once reached)."""

    max_len_given: int | None
    max_slots: int = 1

    @property
    def max_len(self) -> int:
        if self.max_len_given is None:
            raise EngineError("RemoteEngine.config.max_len: unknown; pass max_len= (the "
                              "server's context, /v1/models max_model_len) to RemoteEngine")
        return self.max_len_given


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteStats:
    """What this client sent and received since it was made (not the servers' counters)."""

    generated_tokens: int
    completed: int
    failed: int
    waiting: int  # requests waiting here for a free slot of their nonstop server
    active_slots: int  # requests sent and not yet answered
    cached_tokens: int  # not reported by the servers: 0
    prefix_hit_tokens: int  # not reported by the servers: 0
    policy_version: int
    rerouted: int  # requests sent again to another server after theirs failed
    server_failures: int  # times a server was marked down
    servers_up: int
    weight_updates: int
    weight_sync_s: float  # seconds spent in update_weights and late-join pushes
    restarted: int  # requests a vLLM server aborted for weights, resubmitted with their prefix


class RemoteSession:
    """A multi-turn episode's handle: its turns go to one server, which keeps its KV cache."""

    def __init__(self, engine: RemoteEngine | None, session_id: int) -> None:
        self.id = session_id
        self.closed = False
        self._engine = engine

    def close(self) -> None:
        if not self.closed and self._engine is not None:
            self._engine._forget(self)
        self.closed = True

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
