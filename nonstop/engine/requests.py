"""What the scheduler thread tracks per request and per session, and its counters.

`Request` is one generation in flight, `Session` a multi-turn episode's claim on a slot's KV
cache between its turns (and, after an eviction with swapping on, its `SwappedCache` on the
host), `LaunchedStep` a device call whose tokens the host has not read yet. All are mutated only
by the scheduler thread once submitted (`scheduler.py`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from nonstop.engine.device import StepOutput
from nonstop.engine.types import Completion, FinishReason

if TYPE_CHECKING:
    from nonstop.engine.scheduler import Scheduler


class Detokenizer(Protocol):
    def decode(self, ids: list[int]) -> str: ...


Resolve = Callable[[Completion | BaseException], None]


class Session:
    """A multi-turn episode's claim on one slot's KV cache between its turns.

    Pass it to `Engine.generate(..., session=...)` for every turn, each time with the whole
    context so far; `close()` (or leaving `with session:`) releases the slot.
    """

    def __init__(self, scheduler: Scheduler, session_id: int) -> None:
        self.id = session_id
        self._scheduler = scheduler
        self.closed = False
        # Owned by the scheduler thread:
        self.slot: int | None = None
        self.busy = False
        self.last_used = 0.0
        self.swapped: SwappedCache | None = None  # its cache on the host, after an eviction
        # Paged layout: the blocks it keeps between turns, the tokens they hold, and the
        # policy version that computed them (-1: mixed).
        self.blocks: list[int] | None = None
        self.kv_tokens: list[int] = []
        self.kv_version = -1

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._scheduler.post(("close", self))

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session(id={self.id}, slot={self.slot}, closed={self.closed})"


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists (a slot's cached tokens and
    a new prompt)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwappedCache:
    """An evicted session's cache: the tokens and their keys and values, one array (see
    `DeviceSteps.start_read_slot`). While the copy to the host is under way (`on_host` false)
    it is the device row [2, layers, K, max_len, H]; then a host array
    [2, layers, K, len(tokens), H]."""

    tokens: tuple[int, ...]
    kv: Any
    nbytes: int  # host memory it holds once on the host (what counts against swap_space_gib)
    on_host: bool


@dataclasses.dataclass(eq=False)
class Request:
    """One generation in flight; mutated only by the scheduler thread after submission."""

    prompt: list[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int  # uint32
    max_tokens: int | None
    stop_ids: frozenset[int]
    stop: tuple[str, ...]
    session: Session | None
    resolve: Resolve
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    # Image soft tokens float32[num_image_tokens, D] of a vision-language prompt (engine/images.py).
    image_features: np.ndarray | None = None
    slot: int = -1
    prefill_pos: int = 0
    num_cached: int = 0
    num_prefilled: int = 0
    first_token_at: float | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    sampling_logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    done: bool = False
    epoch: int = 0  # bumped by restart(): decode steps launched before it are dropped
    # What is prefilled when it (re)starts: the prompt, and after a preemption its tokens too.
    context: list[int] = dataclasses.field(default_factory=list)
    # Called by the scheduler thread with (token, logprob, policy version) as each token is
    # recorded (Engine.stream sets it; it must only hand the values to another thread).
    on_token: Callable[[int, float, int], None] | None = None

    def finish_reason(self, token: int, tokenizer: Detokenizer | None, max_len: int
                      ) -> tuple[FinishReason | None, Any]:
        """Whether the request stops at `token` (its latest), why, and on what: a stop id or
        string, `max_tokens`, or the end of a cache of `max_len` positions."""
        if token in self.stop_ids:
            return "stop", token
        if self.stop:
            assert tokenizer is not None
            text = tokenizer.decode(self.tokens)
            for s in self.stop:
                if s in text:
                    return "stop", s
        if self.max_tokens is not None and len(self.tokens) >= self.max_tokens:
            return "length", None
        if len(self.prompt) + len(self.tokens) >= max_len:
            return "cache_full", None
        return None, None

    def completion(self, reason: FinishReason, why: Any) -> Completion:
        return Completion(tokens=self.tokens, logprobs=self.logprobs, finish_reason=reason,
                          policy_versions=self.versions,
                          sampling_logprobs=self.sampling_logprobs, stop_reason=why,
                          num_prefilled=self.num_prefilled, num_cached=self.num_cached,
                          first_token_s=None if self.first_token_at is None
                          else self.first_token_at - self.arrival)

    def preempt(self) -> None:
        """Off its slot to be resumed later: its tokens so far are kept and recomputed with
        the prompt (steps launched before are dropped)."""
        self.epoch += 1
        self.slot, self.prefill_pos = -1, 0

    def restart(self) -> None:
        self.epoch += 1
        self.slot, self.prefill_pos, self.num_cached, self.num_prefilled = -1, 0, 0, 0
        self.first_token_at = None
        for seq in (self.tokens, self.logprobs, self.sampling_logprobs, self.versions):
            seq.clear()


@dataclasses.dataclass(kw_only=True)
class LaunchedStep:
    """A device call (a decode step, or a prefill) whose tokens the host has not read yet."""

    out: StepOutput  # device arrays
    # Decode: (slot, request, request epoch) of every row fed. Prefill: (row, request,
    # request epoch) of the rows whose prompt it finished, whose token is their first.
    rows: tuple[tuple[int, Request, int], ...]
    version: int  # the policy version of the weights it runs on
    launched_ns: int
    prefill: bool = False
    seen_running_ns: int | None = None  # when the host last saw it not yet done


@dataclasses.dataclass
class Counters:
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    prefill_chunks: int = 0  # prompt chunks prefilled (rows of prefill calls)
    prefill_calls: int = 0  # prefill device calls (several chunks each with prefill_rows > 1)
    decode_steps: int = 0  # decode steps (a call runs EngineConfig.decode_steps_per_call)
    decode_calls: int = 0  # decode device calls
    dropped_tokens: int = 0  # sampled in a slot whose request had stopped (or was cancelled)
    completed: int = 0
    evictions: int = 0
    swapped_out: int = 0  # evicted sessions' caches copied to the host
    swapped_in: int = 0  # ... and written back for their next turn
    swap_dropped: int = 0  # ... dropped from the host to stay within swap_space_gib
    parked: int = 0  # evicted sessions' caches moved into the parking cache
    unparked: int = 0  # ... and moved back for their next turn
    park_dropped: int = 0  # ... pushed out of a full parking cache (to the host swap if on)
    preemptions: int = 0  # running requests taken off their slot for blocks (paged)
    prefix_hit_tokens: int = 0  # prompt positions found in the prefix cache (paged)


__all__ = ["Counters", "Detokenizer", "LaunchedStep", "Request", "Resolve", "Session",
           "SwappedCache", "common_prefix"]
