"""The scheduler thread: requests, slots, sessions, and the loop that drives the device.

Each iteration drains the inbox (requests, cancellations, closed sessions, weight updates),
admits waiting turns into slots, launches prefill chunks (up to `prefill_budget` tokens) and one
decode step, then handles the tokens of calls launched earlier while the device computes this
one, so host bookkeeping never leaves the device idle. A slot is free, running a request, or
holding an idle session's KV cache; `slot_tokens[s]` lists the tokens valid in slot s, so a
session's next turn prefills only what follows the common prefix. Eviction, host swap and
parking: docs/engine.md, "Inside the engine" and "Sessions".
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from nonstop import perf
from nonstop.engine.config import EngineConfig
from nonstop.engine.device import DeviceSteps, SamplingArrays
from nonstop.engine.images import image_chunk, image_safe_length
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

PREFILL_TOKENS = "engine/prefill_tokens"  # counter: prompt tokens run through prefill
NO_TOKEN_LIMIT = np.iinfo(np.int64).max  # `token_limit` of a request without max_tokens


class Scheduler(threading.Thread):
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

    def _sampling(self, rows: slice | np.ndarray) -> SamplingArrays:
        return SamplingArrays(self.temperature[rows], self.top_k[rows], self.top_p[rows],
                              self.seeds[rows], self.steps[rows])

    # ---------------------------------------------------------------- device steps

    def _prefill_some(self) -> None:
        used = 0
        while self.prefilling and (used < self.config.prefill_budget or not self.decoding.any()):
            rows = self._next_prefill_rows()
            if not rows:
                return
            try:
                used += self._prefill_call(rows)
            except Exception as error:  # noqa: BLE001 - the device step failed: fail the slots
                self._device_failure(error)
                return

    def _next_prefill_rows(self) -> list[tuple[int, Request, int]]:
        """(slot, request, tokens) of the next prefill call: the oldest prefilling sequence's
        next chunk and, up to `prefill_rows`, the following ones whose next chunk has the same
        length (`EngineConfig.prefill_call_rows`); a chunk holding image tokens goes alone."""
        reqs = [(slot, self.slot_req[slot]) for slot in self.prefilling]
        if self.blocks is not None:  # prompts sharing blocks still being computed wait
            reqs = [(slot, r) for slot, r in reqs if self.blocks.ready(r)]
            if not reqs:
                return []
        slot, req = reqs[0]
        assert req is not None
        if req.image_features is not None:  # the largest chunks: an image run must fit whole
            n = image_safe_length(req.context, req.prefill_pos,
                                  min(len(req.context) - req.prefill_pos,
                                      self.config.chunk_sizes[-1]),
                                  self.device.image_token_id)
            return [(slot, req, n)]
        remaining = [None if r.image_features is not None else len(r.context) - r.prefill_pos
                     for _, r in reqs]
        return [(*reqs[i], n) for i, n in self.config.prefill_call_rows(remaining)]

    def _prefill_call(self, rows: list[tuple[int, Request, int]]) -> int:
        """Launch one prefill call over `rows` (padded to a compiled row count) without waiting
        for it; returns the tokens it spans. The rows that finish their prompt start decoding:
        their first tokens go into `self.first` on the device, where the next decode step
        takes them, and reach the host when the call is read back after that step's launch."""
        S = self.S
        finishing = [req.prefill_pos + n == len(req.context) for _, req, n in rows]
        tables = None if self.blocks is None else self.blocks.tables[[s for s, _, _ in rows]]
        slot, req, n = rows[0]
        launched_ns = self.inflight.launch_time()
        if req.image_features is not None:
            C, start = self.config.padded_size(n), req.prefill_pos
            image_id = self.device.image_token_id
            chunk = np.zeros((1, C), np.int32)
            chunk[0, :n] = req.context[start:start + n]
            with perf.span(perf.ROLLOUT_PREFILL, slot=slot, tokens=n, chunk=C, rows=1):
                feats, lookahead = image_chunk(req.context, req.image_features, start, n, C,
                                               image_id)
                self.cache, out, self.first = self.device.prefill_images_into(
                    self.state, self.cache, chunk, feats, lookahead, start, n, slot,
                    self._sampling(slice(slot, slot + 1)), self.first,
                    slot if finishing[0] else S, tables)
        else:
            C = self.config.padded_size(max(n for _, _, n in rows))
            R = self.config.prefill_row_count(len(rows))
            tokens = np.zeros((R, C), np.int32)
            starts = np.full(R, self.L, np.int32)  # padding rows: parked, length 0
            lengths = np.zeros(R, np.int32)
            slots = np.zeros(R, np.int32)
            targets = np.full(R, S, np.int32)  # where each row's token goes in `first`
            if tables is not None and R > len(rows):  # padding rows: no blocks
                tables = np.concatenate([tables, np.full((R - len(rows), tables.shape[1]),
                                                         self.blocks.none, np.int32)])
            for r, (slot, req, n) in enumerate(rows):
                start = req.prefill_pos
                tokens[r, :n] = req.context[start:start + n]
                starts[r], lengths[r], slots[r] = start, n, slot
                if finishing[r]:
                    targets[r] = slot
            with perf.span(perf.ROLLOUT_PREFILL, slot=rows[0][0], tokens=int(lengths.sum()),
                           chunk=C, rows=len(rows)):
                self.cache, out, self.first = self.device.prefill_into(
                    self.state, self.cache, tokens, starts, lengths, slots, self._sampling(slots),
                    self.first, targets, tables)
        firsts = []
        for r, (slot, req, n) in enumerate(rows):
            start = req.prefill_pos
            req.prefill_pos += n
            req.num_prefilled += n
            self.slot_tokens[slot].extend(req.context[start:start + n])
            self.counters.prefilled_tokens += n
            perf.count(PREFILL_TOKENS, n)
            if not finishing[r]:
                continue
            self.prefilling.remove(slot)
            self.steps[slot] = len(req.tokens) + 1
            self.positions[slot] = len(req.context)
            self.fresh[slot] = True
            self.decoding[slot] = not self._sampled_last(slot)
            firsts.append((r, req, req.epoch))
        self.inflight.add(LaunchedStep(out=out, rows=tuple(firsts), version=self.version,
                                       launched_ns=launched_ns, prefill=True), decode=False)
        self.counters.prefill_chunks += len(rows)
        self.counters.prefill_calls += 1
        return len(rows) * C

    def _decode_step(self) -> None:
        """Launch a decode step over the decoding slots (if any), then read back and hand out
        the tokens of the calls launched before the decode steps left running (`InFlight`),
        in the order the device ran them."""
        previous, self.launched = self.launched, None
        if self.blocks is not None:
            self._grow_blocks()
        active = np.flatnonzero(self.decoding)
        with perf.span(perf.ROLLOUT_DECODE, active=len(active)):
            if len(active):
                try:
                    self.launched = self._launch(active, previous)
                except Exception as error:  # noqa: BLE001 - the device step failed
                    self._device_failure(error)
                    return
            for step in self.inflight.due(launched_decode=self.launched is not None):
                self._read_back(step)
            self.inflight.note_running()

    def _launch(self, active: np.ndarray, previous: LaunchedStep | None) -> LaunchedStep:
        K = self.config.decode_steps_per_call
        attend_len = self.config.attention_length(int(self.positions[active].max()) + K - 1)
        perf.gauge(perf.ENGINE_ACTIVE_SLOTS, len(active))
        perf.gauge(perf.ENGINE_QUEUE_DEPTH, len(self.waiting) + len(self.returning))
        # A slot that was in the previous step (not fresh from prefill) is fed the token that
        # step sampled, a fresh one the first token its prefill put in `self.first`: both
        # stay on the device, the host reads neither first. (With no previous step every
        # active slot is fresh.) Copies: the host arrays change while the device may still be
        # reading its inputs.
        launched_ns = self.inflight.launch_time()
        self.cache, out = self.device.decode(
            self.state, self.cache, self.first, self.positions.copy(),
            SamplingArrays(*(a.copy() for a in self._sampling(slice(None)))), attend_len,
            previous.out.tokens if previous is not None else None, ~self.fresh,
            None if self.blocks is None else self.blocks.tables.copy())
        self.counters.decode_steps += K
        self.counters.decode_calls += 1
        self.fresh[active] = False
        self.positions[active] += K
        self.steps[active] += K
        # A request this call takes to its max_tokens or the end of the cache leaves the
        # batch now: no later step is computed for it only to be dropped. (It keeps its slot
        # until the call is read back and it finishes.)
        self.decoding[active] = ~self._sampled_last(active)
        rows = tuple((int(s), self.slot_req[s], self.slot_req[s].epoch) for s in active)
        step = LaunchedStep(out=out, rows=rows, version=self.version, launched_ns=launched_ns)
        self.inflight.add(step, decode=True)
        return step

    def _sampled_last(self, slots: Any) -> Any:
        """Whether the steps launched for `slots` already sample their requests' last
        possible token (`max_tokens`, or the cache's last position): `Request.finish_reason`
        ends the request there at the latest."""
        return (self.steps[slots] >= self.token_limit[slots]) | (
            self.positions[slots] + 1 >= self.L)

    def _read_back(self, step: LaunchedStep) -> None:
        was_running = not step.out.tokens.is_ready()
        try:
            out = jax.device_get(step.out)
        except Exception as error:  # noqa: BLE001
            self._device_failure(error)
            return
        self.inflight.record_busy(step, was_running=was_running)
        if step.prefill:
            self._emit_first_tokens(step, out)
            return
        # Rows [K, S]: step k of the call (K = 1: one step).
        tokens = out.tokens.reshape(-1, self.S).tolist()
        logprobs = out.logprobs.reshape(-1, self.S).tolist()
        sampling_logprobs = out.sampling_logprobs.reshape(-1, self.S).tolist()
        K = len(tokens)
        emitted = 0
        for s, req, epoch in step.rows:
            for k in range(K):
                if req.done or req.epoch != epoch or self.slot_req[s] is not req:
                    # Finished, cancelled or restarted since this call was launched (or at an
                    # earlier step of it): the rest of its tokens are dropped.
                    self.counters.dropped_tokens += K - k
                    break
                self.slot_tokens[s].append(req.tokens[-1])  # the token step k was fed
                emitted += 1
                self._emit(req, tokens[k][s], logprobs[k][s], sampling_logprobs[k][s],
                           step.version)
        perf.count(perf.ENGINE_TOKENS, emitted)

    def _emit_first_tokens(self, step: LaunchedStep, out: Any) -> None:
        """Hand out the first tokens a prefill call sampled (rows that finished a prompt)."""
        for r, req, epoch in step.rows:
            if req.done or req.epoch != epoch:
                self.counters.dropped_tokens += 1  # cancelled or restarted meanwhile
                continue
            perf.count(perf.ENGINE_TOKENS, 1)
            self._emit(req, int(out.tokens[r]), float(out.logprobs[r]),
                       float(out.sampling_logprobs[r]), step.version)

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
