"""The rollout protocol: what the agent, the orchestrator, the learners, the evaluator and the
server call on an engine, written down so that any backend can stand in for the in-process one.

    def run(engine: RolloutEngine) -> None: ...
    run(Engine(model, cfg))          # in-process JAX (engine.py)
    run(VLLMEngine(model, cfg))      # vLLM in-process (vllm_engine.py, the `vllm` extra)

Three levels, each a `typing.Protocol` (runtime-checkable, so `isinstance` checks that the
members exist; signatures are for the type checker):

- `RolloutClient`: generate token ids from token ids (`generate`), in an optional `session`
  (a multi-turn episode; backends with a prefix cache turn its later turns into prefix hits),
  with per-token log-probs and policy versions in the `Completion`; `stats()`;
  `close()` and both context managers. Cancel is asyncio's: cancelling the task that awaits
  `generate` frees the request (its slot, its KV blocks, its place in the queue). A bad request
  raises `RequestError` in its own caller and nothing else. `config.max_len` is the context
  (prompt plus completion) one request may fill. The evaluator needs only this.
- `RolloutEngine`: a client whose weights the trainer owns: `update_weights(state, version)`
  takes NNX parameter state (`nnx.state(model, nnx.Param)`, LoRA adapters included: a backend
  that cannot run adapters merges them); every request submitted after it returns samples
  with the new weights, and its tokens carry `version` (it may return before the switch, as
  the in-process engine's does, or after, as vLLM's does); `policy_version` is the version of
  the weights in use. Both learners need this.
- `ServingEngine`: a rollout engine that also streams tokens as they are sampled and names its
  model config (vocabulary size): what `nonstop serve` needs.

Busy time: every backend records its device-busy intervals with
`perf.device_busy_interval(perf.ENGINE, ...)`, so `perf.busy_seconds(perf.ENGINE)` and the run
report's engine busy fraction read the same way whichever engine ran the rollouts. (The
in-process engine measures its device calls; vLLM's busy time is measured from the host as the
union of the intervals in which it had requests running.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from flax import nnx

from nonstop.engine.sampling import SamplingParams
from nonstop.engine.types import Completion


@runtime_checkable
class RolloutSession(Protocol):
    """One multi-turn episode's handle: pass it to every turn's `generate`, then close it."""

    def close(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...


class RolloutLimits(Protocol):
    """What callers read from `engine.config`: the per-request context and the concurrency."""

    @property
    def max_len(self) -> int: ...

    @property
    def max_slots(self) -> int: ...


class RolloutStats(Protocol):
    """What callers read from `engine.stats()` (the in-process engine reports more)."""

    @property
    def generated_tokens(self) -> int: ...

    @property
    def completed(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def active_slots(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...

    @property
    def prefix_hit_tokens(self) -> int: ...

    @property
    def policy_version(self) -> int: ...


@runtime_checkable
class RolloutClient(Protocol):
    """Generation with sessions, log-probs and versions; see the module docstring."""

    @property
    def config(self) -> RolloutLimits: ...

    async def generate(
        self,
        token_ids: Sequence[int] | np.ndarray,
        params: SamplingParams | None = None,
        session: Any = None,
    ) -> Completion: ...

    def session(self) -> RolloutSession: ...

    def stats(self) -> RolloutStats: ...

    def close(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc: object) -> None: ...


@runtime_checkable
class RolloutEngine(RolloutClient, Protocol):
    """A `RolloutClient` whose weights the trainer publishes; see the module docstring."""

    @property
    def policy_version(self) -> int: ...

    def update_weights(self, params: nnx.State, version: int) -> None: ...


class _ModelConfig(Protocol):
    @property
    def vocab_size(self) -> int: ...


class _Chunk(Protocol):
    @property
    def tokens(self) -> tuple[int, ...]: ...

    @property
    def completion(self) -> Completion | None: ...


@runtime_checkable
class ServingEngine(RolloutEngine, Protocol):
    """A `RolloutEngine` that streams (what `nonstop serve` drives)."""

    @property
    def model_config(self) -> _ModelConfig: ...

    def stream(
        self,
        token_ids: Sequence[int] | np.ndarray,
        params: SamplingParams | None = None,
        session: Any = None,
    ) -> AsyncIterator[_Chunk]: ...


__all__ = [
    "RolloutClient",
    "RolloutEngine",
    "RolloutLimits",
    "RolloutSession",
    "RolloutStats",
    "ServingEngine",
]
