"""The scheduler thread's device calls: prefill chunks, decode steps, and reading back their
tokens in launch order.

`DeviceCalls` is a mixin of `Scheduler` (`scheduler.py`), whose `__init__` holds all the state
these methods use; they hand sampled tokens to its `_emit` and device errors to its
`_device_failure`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from nonstop import perf
from nonstop.engine.device import SamplingArrays
from nonstop.engine.images import image_chunk, image_safe_length
from nonstop.engine.requests import LaunchedStep, Request

PREFILL_TOKENS = "engine/prefill_tokens"  # counter: prompt tokens run through prefill


class DeviceCalls:
    """Launching prefill and decode calls without waiting, and handing out their tokens."""

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

    def _sampling(self, rows: slice | np.ndarray) -> SamplingArrays:
        return SamplingArrays(self.temperature[rows], self.top_k[rows], self.top_p[rows],
                              self.seeds[rows], self.steps[rows])
