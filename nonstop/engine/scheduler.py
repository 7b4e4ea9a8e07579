"""The scheduler thread: requests, slots, sessions, and the loop that drives the device.

Each iteration drains the inbox (requests, cancellations, closed sessions, weight updates),
admits waiting turns into slots, launches prefill chunks (up to `prefill_budget` tokens) and one
decode step, then handles the tokens of calls launched earlier while the device computes this
one, so host bookkeeping never leaves the device idle. A slot is free, running a request, or
holding an idle session's KV cache; `slot_tokens[s]` lists the tokens valid in slot s, so a
session's next turn prefills only what follows the common prefix. Eviction, host swap and
parking: docs/engine.md, "Inside the engine" and "Sessions". The device calls themselves (prefill,
decode, read-back) are in `device_calls.py`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import numpy as np
from flax import nnx

from nonstop import perf
from nonstop.engine.config import EngineConfig
from nonstop.engine.device import DeviceSteps
from nonstop.engine.device_calls import DeviceCalls
from nonstop.engine.inflight import InFlight
from nonstop.engine.paging import PagedBlocks
from nonstop.engine.requests import (
    Counters,
    Detokenizer,
    LaunchedStep,
    Request,
    Session,
    common_prefix,
)
from nonstop.engine.swap import EvictedCaches
from nonstop.engine.types import EngineError, FinishReason, RequestError

_log = logging.getLogger(__name__)

NO_TOKEN_LIMIT = np.iinfo(np.int64).max  # `token_limit` of a request without max_tokens


class Scheduler(DeviceCalls, threading.Thread):
    """Owns the slots, the cache and the params; only this thread touches the device."""

    def __init__(self, device: DeviceSteps, state: nnx.State, version: int,
                 config: EngineConfig, tokenizer: Detokenizer | None) -> None:
        super().__init__(name="nonstop-engine", daemon=True)
        self.device, self.state, self.version = device, state, version
        self.config, self.tokenizer = config, tokenizer
        S, L = config.max_slots, config.max_len
        self.S, self.L = S, L
        self.cache = device.new_cache()
        self.counters = Counters()
        self.ready = threading.Event()
        self.startup_error: BaseException | None = None
        self._cv = threading.Condition()
        self._inbox: collections.deque[tuple[Any, ...]] = collections.deque()
        self._stopping = False
        self.waiting: collections.deque[Request] = collections.deque()  # for a slot, in order
        # Sessions' next turns whose cache still holds a slot: nothing takes a busy session's
        # slot, so each goes back into its own at the next admission, queueing for nothing.
        self.returning: collections.deque[Request] = collections.deque()
        self.slot_req: list[Request | None] = [None] * S
        self.slot_owner: list[Session | None] = [None] * S
        self.slot_tokens: list[list[int]] = [[] for _ in range(S)]
        self.prefilling: collections.deque[int] = collections.deque()
        self.decoding = np.zeros(S, bool)
        self.fresh = np.zeros(S, bool)  # next input token is its prefill's, from `first`
        self.launched: LaunchedStep | None = None  # the last decode step launched
        self.inflight = InFlight(config.pipeline_depth)
        self.first = device.new_first()  # device int32[S]: fresh slots' first tokens
        self.positions = np.full(S, L, np.int32)
        self.temperature = np.zeros(S, np.float32)
        self.top_k = np.zeros(S, np.int32)
        self.top_p = np.ones(S, np.float32)
        self.seeds = np.zeros(S, np.uint32)
        self.steps = np.zeros(S, np.int32)  # tokens sampled (or launched) for the request
        self.token_limit = np.zeros(S, np.int64)  # the request's max_tokens (or no limit)
        self.evicted = EvictedCaches(device, config, self.counters)
        # Paged layout: block tables, sessions' blocks, prefix cache (`paging.py`). Sessions
        # then hold blocks, never a slot, between turns.
        self.blocks = self._new_blocks() if config.kv_layout == "paged" else None

    def _new_blocks(self) -> PagedBlocks:
        swap = self._swap_out_blocks if self.config.swap_space_gib > 0 else None
        return PagedBlocks(self.config, self.S, self.counters, swap_out=swap)

    # ---------------------------------------------------------------- from other threads

    def post(self, message: tuple[Any, ...]) -> None:
        with self._cv:
            if self._stopping and message[0] == "submit":
                raise EngineError("the engine is stopped")
            self._inbox.append(message)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()

    # ---------------------------------------------------------------- the loop

    def run(self) -> None:
        try:
            self.cache = self.device.warmup(self.state, self.cache, self.config.chunk_sizes,
                                            self.config.attention_lengths,
                                            swap=self.evicted.swap.budget > 0,
                                            prefill_rows=self.config.prefill_row_counts)
            self.cache = self.evicted.warmup(self.cache)
        except BaseException as error:  # noqa: BLE001 - reported to start() and every caller
            self.startup_error = error
            self.ready.set()
            self._drain(block=False)
            self._abort_all(EngineError(f"engine warm-up failed: {error!r}"))
            return
        self.ready.set()
        try:
            while True:
                idle = (not self.waiting and not self.returning and not self.prefilling
                        and not self.decoding.any() and not self.inflight)
                if idle:
                    self._settle_swaps(wait=True)  # nothing else to do: free the device rows
                self._drain(block=idle)
                if self._stopping:
                    break
                self._admit()
                if self.prefilling:
                    self._prefill_some()
                self._decode_step()
                self._settle_swaps()
        finally:
            with self._cv:
                self._stopping = True
            self._drain(block=False)
            self._abort_all(None)

    def _drain(self, *, block: bool) -> None:
        with self._cv:
            while block and not self._inbox and not self._stopping:
                self._cv.wait()
            messages = list(self._inbox)
            self._inbox.clear()
        for message in messages:
            kind = message[0]
            if kind == "submit":
                self._accept(message[1])
            elif kind == "cancel":
                self._cancel(message[1])
            elif kind == "close":
                self._close_session(message[1])
            elif kind == "weights":
                self._apply_weights(message[1], message[2])

    def _accept(self, req: Request) -> None:
        if self._stopping:
            req.done = True
            req.resolve(EngineError("the engine is stopping"))
            return
        s = req.session
        if s is not None and (s.closed or s.busy):
            why = "is closed" if s.closed else "already has a request in flight"
            req.done = True
            req.resolve(RequestError(f"session {s.id} {why}"))
            return
        if s is not None:
            s.busy = True
            if s.slot is not None:
                self.returning.append(req)
                return
        self.waiting.append(req)

    def _cancel(self, req: Request) -> None:
        if req.done:
            return
        req.done = True
        if req.slot >= 0:
            self._release(req)
        else:
            (self.returning if req in self.returning else self.waiting).remove(req)
            if req.session is not None:
                req.session.busy = False

    def _close_session(self, session: Session) -> None:
        if not session.busy:
            if self.blocks is not None:
                self.blocks.drop_session(session)
            self._drop_session_cache(session)
            self.evicted.drop(session)

    def _drop_session_cache(self, session: Session) -> None:
        s = session.slot
        if s is not None:
            self.slot_owner[s] = None
            self.slot_tokens[s] = []
            session.slot = None

    # ---------------------------------------------------------------- admission

    def _free_slot(self) -> int | None:
        """A free slot, else one taken from the least recently used idle session (its cache
        parked, or swapped out if the budget allows); None if there is neither. (Paged:
        sessions hold no slot, so a slot is free when it runs nothing.)"""
        if self.blocks is not None:
            return next((s for s in range(self.S) if self.slot_req[s] is None), None)
        for s in range(self.S):
            if self.slot_req[s] is None and self.slot_owner[s] is None:
                return s
        idle = [o for o in self.slot_owner if o is not None and not o.busy]
        if not idle:
            return None
        victim = min(idle, key=lambda o: o.last_used)
        slot = victim.slot
        assert slot is not None
        if not self._evict(victim, slot):
            return None
        self._drop_session_cache(victim)
        self.counters.evictions += 1
        return slot

    def _evict(self, session: Session, slot: int) -> bool:
        """Keep an evicted session's cache, parked or swapped out if on (`EvictedCaches.evict`;
        False: the device failed, and every slot with it)."""
        try:
            self.cache = self.evicted.evict(self.cache, session, slot, self.slot_tokens[slot])
        except Exception as error:  # noqa: BLE001 - the device failed: fail the slots
            self._device_failure(error)
            return False
        return True

    def _settle_swaps(self, *, wait: bool = False) -> None:
        """Take the swap copies that have reached the host (with `wait`, all) off the
        device."""
        try:
            self.evicted.settle(wait=wait)
        except Exception as error:  # noqa: BLE001 - the device failed: fail the slots
            self._device_failure(error)

    def _admit(self) -> None:
        """Returning turns into their sessions' slots, then waiting requests in arrival order
        until no slot is free or evictable: O(admitted), however long the queue. The pass's
        parking moves run as one call at its end, before anything is prefilled."""
        while self.returning:
            req = self.returning.popleft()
            assert req.session is not None and req.session.slot is not None
            self._start(req, req.session.slot)
        while self.waiting:
            slot = self._free_slot()
            if slot is None:
                break
            req = self.waiting.popleft()
            if not self._start(req, slot):  # no blocks for it yet: it waits at the front
                self.waiting.appendleft(req)
                break
        if self.evicted.pending:
            try:
                self.cache = self.evicted.flush(self.cache)
            except Exception as error:  # noqa: BLE001 - the device failed: fail the slots
                self._device_failure(error)

    def _requeue_returning(self) -> None:
        """After sessions' caches were dropped wholesale: their waiting turns queue for a slot
        like any request, in arrival order."""
        if self.returning:
            self.waiting = collections.deque(sorted((*self.waiting, *self.returning),
                                                    key=lambda r: r.arrival))
            self.returning.clear()

    def _start(self, req: Request, slot: int) -> bool:
        """Put `req` into `slot` to prefill what its cache lacks; False (nothing changed) if
        the paged pool cannot hold its context yet."""
        req.context = req.prompt + req.tokens  # tokens: kept over a preemption
        cached = self.slot_tokens[slot]
        if self.blocks is not None:
            running = sum(r is not None for r in self.slot_req)
            n = self.blocks.admit(req, slot, req.context, self.version, running=running,
                                  share=self.config.prefix_cache and req.image_features is None)
            if n is None:
                return False
            if self.blocks.restore is not None:  # its host copy goes into its new blocks
                session, ids = self.blocks.restore
                self.blocks.restore = None
                try:
                    self.cache = self.evicted.restore_blocks(self.cache, session, ids)
                except Exception as error:  # noqa: BLE001 - fails this and every slot
                    self._device_failure(error)
                    return True
            cached[:] = req.context[:n]
        req.slot = slot
        self.slot_req[slot] = req
        if self.blocks is None and req.session is not None:
            self.slot_owner[slot] = req.session
            req.session.slot = slot
            try:
                self.cache, kept = self.evicted.restore(
                    self.cache, req.session, slot,
                    into_slot=not cached and req.image_features is None)
            except Exception as error:  # noqa: BLE001 - fails this and every slot
                self._device_failure(error)
                return True
            cached.extend(kept)
        elif self.blocks is None:
            cached.clear()
        n = min(common_prefix(cached, req.context), len(req.context) - 1)
        if req.image_features is not None:  # equal placeholders may stand for other images
            n = 0
        del cached[n:]
        req.prefill_pos = req.num_cached = n
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = (
            req.temperature, req.top_k, req.top_p)
        self.seeds[slot], self.steps[slot] = req.seed, len(req.tokens)
        self.token_limit[slot] = req.max_tokens if req.max_tokens is not None else NO_TOKEN_LIMIT
        self.positions[slot] = self.L
        self.prefilling.append(slot)
        return True

    # ---------------------------------------------------------------- per-request bookkeeping

    def _emit(self, req: Request, token: int, logprob: float, sampling_logprob: float,
              version: int) -> None:
        """Record a token sampled by weights `version`; finish the request if it stops here."""
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.tokens.append(token)
        req.logprobs.append(logprob)
        req.sampling_logprobs.append(sampling_logprob)
        req.versions.append(version)
        self.counters.generated_tokens += 1
        if req.on_token is not None:
            req.on_token(token, logprob, version)
        try:
            reason, why = req.finish_reason(token, self.tokenizer, self.L)
        except Exception as error:  # noqa: BLE001 - e.g. the tokenizer failed on this request
            self._fail(req, EngineError(f"checking stop conditions failed: {error!r}"))
            return
        if reason is not None:
            self._finish(req, reason, why)

    def _finish(self, req: Request, reason: FinishReason, why: Any = None) -> None:
        req.done = True
        self._release(req)
        self.counters.completed += 1
        req.resolve(req.completion(reason, why))

    def _fail(self, req: Request, error: BaseException) -> None:
        req.done = True
        if req.slot >= 0:
            self._release(req)
        req.resolve(error)

    def _release(self, req: Request) -> None:
        """Take a request off its slot; its session (if open) keeps the slot's cache."""
        s = req.slot
        self.slot_req[s] = None
        self.decoding[s] = False
        self.positions[s] = self.L
        if s in self.prefilling:
            self.prefilling.remove(s)
        session = req.session
        if self.blocks is not None:
            self._release_blocks(req, s)
        if session is not None:
            session.busy = False
            session.last_used = time.perf_counter()
            if session.closed:
                self._drop_session_cache(session)
        else:
            self.slot_tokens[s] = []
        req.slot = -1

    # ---------------------------------------------------------------- paged layout

    def _release_blocks(self, req: Request, slot: int) -> None:
        """`req` leaves `slot`: its blocks are keyed and kept by its session or freed; requests
        waiting for prompt blocks it had not computed yet restart."""
        assert self.blocks is not None
        # Blocks shared with a writer that has not computed them yet hold nothing yet: none
        # is keyed or kept (the request waited for them, so it computed nothing either).
        tokens = self.slot_tokens[slot] if self.blocks.ready(req) else []
        followers = self.blocks.writer_gone(req)
        self.blocks.release(slot, tokens, self.version, session=req.session,
                            share=self.config.prefix_cache)
        self.slot_tokens[slot] = []
        self.slot_owner[slot] = None
        for follower in followers:
            if follower.slot >= 0 and not follower.done:
                self._preempt(follower)

    def _swap_out_blocks(self, session: Session, blocks: list[int], tokens: list[int]) -> None:
        """Copy an idle session's blocks, about to be freed, to the host (if the budget
        allows); if the device cannot, they are freed for recompute as without swapping."""
        try:
            self.evicted.swap.copy_out_blocks(session, tokens, self.device, self.cache, blocks)
        except Exception:  # noqa: BLE001 - the next device call reports the failure
            _log.exception("copying an idle session's blocks to the host failed")

    def _grow_blocks(self) -> None:
        """Blocks for the positions the next decode call writes, oldest request first; when
        the pool is out of them, the youngest running request is preempted (resumed later by
        recomputing its context), the asking one included."""
        assert self.blocks is not None
        K = self.config.decode_steps_per_call
        order = sorted(np.flatnonzero(self.decoding), key=lambda s: self.slot_req[s].arrival)
        for slot in order:
            req = self.slot_req[slot]
            if req is None or not self.decoding[slot]:
                continue  # preempted for an older one meanwhile
            upto = min(int(self.positions[slot]) + K, self.L)
            while not self.blocks.grow(slot, upto):
                running = [r for r in self.slot_req if r is not None]
                victim = max(running, key=lambda r: r.arrival)
                self._preempt(victim)
                if victim is req:
                    break

    def _preempt(self, req: Request) -> None:
        """Take a running request off its slot and blocks; it waits at the front of the queue
        and resumes by prefilling its prompt and its tokens so far."""
        self._release(req)
        if req.session is not None:
            req.session.busy = True
        req.preempt()
        self.counters.preemptions += 1
        # Back in arrival order: ahead of the (usually younger) waiting requests.
        at = next((i for i, w in enumerate(self.waiting) if w.arrival > req.arrival),
                  len(self.waiting))
        self.waiting.insert(at, req)

    # ---------------------------------------------------------------- engine-wide events

    def _apply_weights(self, state: nnx.State, version: int) -> None:
        with perf.span("engine/weight_update", policy_version=version):
            self.state, self.version = state, version
        if self.blocks is not None:
            self.blocks.weights_changed()
            for session in self.evicted.swap.sessions:  # host copies: not keyed when back
                session.kv_version = -1
        if self.config.on_weight_update == "continue":
            return
        running = sorted((r for r in self.slot_req if r is not None), key=lambda r: r.arrival)
        for req in running:
            self._release(req)
            if req.session is not None:
                req.session.busy = True
            req.restart()
        for owner in list(self.slot_owner):  # caches computed by the old weights
            if owner is not None:
                self._drop_session_cache(owner)
        if self.blocks is not None:
            for session in list(self.blocks.idle):
                self.blocks.drop_session(session)
        self.evicted.clear()
        self._requeue_returning()
        self.waiting.extendleft(reversed(running))

    def _device_failure(self, error: BaseException) -> None:
        _log.exception("engine device step failed; failing the requests in its slots")
        for req in [r for r in self.slot_req if r is not None]:
            self._fail(req, EngineError(f"a device step failed: {error!r}"))
        for owner in list(self.slot_owner):
            if owner is not None:
                self._drop_session_cache(owner)
        self._requeue_returning()
        self.evicted.reset()
        self.launched = None
        self.inflight.clear()
        self.first = self.device.new_first()
        self.cache = self.device.new_cache()  # the old one may have been donated
        if self.blocks is not None:  # every block's contents are lost with the cache
            for session in list(self.blocks.idle):
                self.blocks.drop_session(session)
            self.blocks = self._new_blocks()

    def _abort_all(self, error: BaseException | None) -> None:
        """Stop: running requests end "aborted" with what they have; waiting ones likewise."""
        for req in [r for r in self.slot_req if r is not None] + [*self.returning,
                                                                  *self.waiting]:
            if req.done:
                continue
            req.done = True
            if req.slot >= 0:
                self._release(req)
            req.resolve(error if error is not None else req.completion("aborted", None))
        self.waiting.clear()
        self.returning.clear()
