"""Where evicted sessions' KV caches go, so a session's next turn prefills only its new tokens:
the parking cache on the device (`Parking`, `EngineConfig.parked_slots`), and host swap space
within a byte budget (`HostSwap`, `EngineConfig.swap_space_gib`).

Parking: the moves of one admission pass (rows of the sessions it evicts into free parking
rows, rows of the sessions it readmits back into their new slots) run as one device call
(`DeviceSteps.park`) at the end of the pass, before any prefill. When the parking cache is full
the least recently parked session goes on to the host swap space if it is on, else its cache is
dropped.

Host swap (dense layout; the paged one copies an idle session's blocks out instead, when the
pool runs short and they would otherwise be freed, and writes them into new blocks at its next
turn: `HostSwap.copy_out_blocks`, `EvictedCaches.restore_blocks`):

When the scheduler thread evicts an idle session it launches a copy of the slot's keys and
values (`DeviceSteps.start_read_slot`) and hands the device rows to `HostSwap.store` without
waiting for them; `settle` later swaps each copy that has reached the host for host arrays of
just the session's positions, which frees the device rows. A turn that comes back before its
copy settled is written back from the device rows directly. The least recently evicted copies
are dropped first to make room. Only the scheduler thread touches it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import numpy as np

from nonstop import perf
from nonstop.engine.config import EngineConfig
from nonstop.engine.device import DeviceSteps
from nonstop.engine.requests import Counters, Session, SwappedCache
from nonstop.models.decoder import KVCache

SWAP = "engine/swap"  # span: an evicted session's cache copied to the host, or back
PARK = "engine/park"  # span: an admission pass's moves into and out of the parking cache


class Parking:
    """Idle sessions' caches in the parking cache's rows, least recently parked first, and the
    moves of the current admission pass not yet run."""

    def __init__(self, rows: int, counters: Counters) -> None:
        self.sessions: collections.OrderedDict[Session, int] = collections.OrderedDict()
        self.tokens: list[list[int]] = [[] for _ in range(rows)]  # valid in each row
        self.free = list(range(rows - 1, -1, -1))
        # Rows moved back this pass: free again once its call has run (a call must not fill a
        # row it also restores, see `DeviceSteps.park`).
        self.releasing: list[int] = []
        self.outs: list[tuple[int, int]] = []  # (cache slot, parking row) to run
        self.ins: list[tuple[int, int]] = []  # (parking row, cache slot) to run
        self.counters = counters

    @property
    def pending(self) -> bool:
        return bool(self.outs or self.ins)

    def full(self) -> bool:
        return not self.free

    def oldest(self) -> tuple[Session, int]:
        """The least recently parked session and its row."""
        return next(iter(self.sessions.items()))

    def writing(self, row: int) -> bool:
        """Whether a move of this pass not yet run fills `row`."""
        return any(r == row for _, r in self.outs)

    def park(self, session: Session, slot: int, tokens: list[int]) -> None:
        """Move `session`'s cache (slot `slot`, valid for `tokens`) into a free row."""
        row = self.free.pop()
        self.sessions[session] = row
        self.tokens[row] = tokens
        self.outs.append((slot, row))
        self.counters.parked += 1

    def unpark(self, session: Session, slot: int) -> list[int]:
        """Move `session`'s parked cache into slot `slot`; returns the tokens it holds."""
        row = self.sessions.pop(session)
        self.ins.append((row, slot))
        self.releasing.append(row)
        tokens, self.tokens[row] = self.tokens[row], []
        self.counters.unparked += 1
        return tokens

    def drop(self, session: Session) -> None:
        """Forget `session`'s parked cache, if it has one."""
        row = self.sessions.pop(session, None)
        if row is not None:
            self.tokens[row] = []
            self.free.append(row)

    def take_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The pass's moves, to run now (the rows they move back are free again)."""
        moves = self.outs, self.ins
        self.outs, self.ins = [], []
        self.free.extend(self.releasing)
        self.releasing.clear()
        return moves

    def clear(self) -> None:
        """Forget every parked cache and every move not yet run."""
        for session in list(self.sessions):
            self.drop(session)
        self.take_moves()


class HostSwap:
    """Evicted sessions' caches on the host, least recently evicted first."""

    def __init__(self, budget_bytes: int, counters: Counters,
                 to_host: Callable[[object, int], np.ndarray] = DeviceSteps.slot_to_host
                 ) -> None:
        self.to_host = to_host  # (device copy, positions) -> the host copy of those positions
        self.budget = budget_bytes
        self.bytes = 0
        self.sessions: collections.OrderedDict[Session, None] = collections.OrderedDict()
        self.copying: dict[Session, None] = {}  # copies not on the host yet, in launch order
        self.counters = counters

    def fits(self, nbytes: int) -> bool:
        """Whether a copy of `nbytes` can be kept at all (0 bytes: nothing to keep)."""
        return 0 < nbytes <= self.budget

    def make_room(self, nbytes: int) -> None:
        """Drop the least recently evicted copies until `nbytes` more fit."""
        while self.bytes + nbytes > self.budget:
            self.drop(next(iter(self.sessions)))
            self.counters.swap_dropped += 1

    def copy_out(self, session: Session, tokens: list[int], device: DeviceSteps, cache: KVCache,
                 slot: int) -> None:
        """Launch a copy of the cache of `session`, being evicted from `slot` (whose valid
        positions hold `tokens`), if the budget allows, without waiting for it. A device error
        propagates, with nothing stored."""
        nbytes = len(tokens) * device.slot_position_bytes()
        if not self.fits(nbytes):
            return
        self.make_room(nbytes)
        with perf.span(SWAP, direction="out", tokens=len(tokens)):
            kv = device.start_read_slot(cache, slot)
        self.store(session, SwappedCache(tokens=tuple(tokens), kv=kv, nbytes=nbytes,
                                         on_host=False))

    def copy_out_blocks(self, session: Session, tokens: list[int], device: DeviceSteps,
                        cache: KVCache, blocks: list[int]) -> None:
        """Paged layout: launch a copy of the `blocks` of `session` (holding `tokens`), whose
        blocks are about to be freed, if the budget allows, without waiting for it."""
        nbytes = len(blocks) * device.block_bytes()
        if not self.fits(nbytes):
            return
        self.make_room(nbytes)
        with perf.span(SWAP, direction="out", tokens=len(tokens)):
            kv = device.start_read_blocks(cache, blocks)
        self.store(session, SwappedCache(tokens=tuple(tokens), kv=kv, nbytes=nbytes,
                                         on_host=False))

    def store(self, session: Session, cache: SwappedCache) -> None:
        session.swapped = cache
        self.sessions[session] = None
        if not cache.on_host:
            self.copying[session] = None
        self.bytes += cache.nbytes
        self.counters.swapped_out += 1

    def settle(self, *, wait: bool = False) -> None:
        """Take the copies that have reached the host (all of them, waiting, with `wait`) as
        host arrays of the sessions' positions, freeing their device rows. A device error
        propagates; the copies not yet settled are kept."""
        for session in list(self.copying):
            cache = session.swapped
            assert cache is not None and not cache.on_host
            if not wait and not cache.kv.is_ready():
                break  # launched in order: the later ones are not done either
            session.swapped = dataclasses.replace(
                cache, kv=self.to_host(cache.kv, len(cache.tokens)), on_host=True)
            del self.copying[session]

    def drop(self, session: Session) -> None:
        """Forget `session`'s copy, if it has one."""
        if session.swapped is not None:
            self.bytes -= session.swapped.nbytes
            session.swapped = None
            del self.sessions[session]
            self.copying.pop(session, None)

    def drop_copying(self) -> None:
        """Forget the copies not on the host yet (after a device failure that may have hit
        them)."""
        for session in list(self.copying):
            self.drop(session)

    def clear(self) -> None:
        for session in list(self.sessions):
            self.drop(session)


class EvictedCaches:
    """The scheduler's one door to both: where an evicted session's cache goes (the parking
    cache if on, else the host swap), and how it comes back. Methods that launch device work
    take the engine's cache and return it (donated and replaced); a device error propagates,
    and the scheduler then fails every slot and calls `reset`."""

    def __init__(self, device: DeviceSteps, config: EngineConfig, counters: Counters) -> None:
        self.device = device
        self.swap = HostSwap(int(config.swap_space_gib * 2**30), counters,
                             device.blocks_to_host if device.paged else DeviceSteps.slot_to_host)
        self.parking = Parking(config.parked_slots, counters)
        self.pool = device.new_pool() if config.parked_slots else None  # the parking cache
        self.counters = counters

    @property
    def pending(self) -> bool:
        """Whether parking moves are planned and not yet run (see `flush`)."""
        return self.parking.pending

    def warmup(self, cache: KVCache) -> KVCache:
        """Compile the parking moves (the host swap's calls compile in `DeviceSteps.warmup`)."""
        if self.pool is not None:
            cache, self.pool = self.device.warmup_park(cache, self.pool,
                                                       swap=self.swap.budget > 0)
        return cache

    def evict(self, cache: KVCache, session: Session, slot: int, tokens: list[int]
              ) -> KVCache:
        """Keep the cache of `session`, evicted from `slot` (valid for `tokens`, which it
        takes): plan its move into the parking cache (making room first: the least recently
        parked goes to the host swap if on, else is dropped), or launch its copy to the host."""
        if self.pool is None:
            self.swap.copy_out(session, tokens, self.device, cache, slot)
            return cache
        if self.parking.full():
            old, row = self.parking.oldest()
            if self.swap.budget:
                if self.parking.writing(row):  # filled by this pass: run its move first
                    cache = self.flush(cache)
                self.swap.copy_out(old, self.parking.tokens[row], self.device, self.pool, row)
            self.parking.drop(old)
            self.counters.park_dropped += 1
        self.parking.park(session, slot, tokens)
        return cache

    def restore(self, cache: KVCache, session: Session, slot: int, *, into_slot: bool
                ) -> tuple[KVCache, list[int]]:
        """Bring `session`'s kept cache (if any) back into `slot`, which must hold nothing
        valid, and return the tokens it is valid for; without `into_slot` (the slot holds a
        cache already, or the prompt has images) just forget it."""
        if session in self.parking.sessions:
            if into_slot:
                return cache, self.parking.unpark(session, slot)
            self.parking.drop(session)
        swapped = session.swapped
        if swapped is None:
            return cache, []
        self.swap.drop(session)
        if not into_slot:
            return cache, []
        if self.pending:  # a parked victim's row leaves this slot first
            cache = self.flush(cache)
        with perf.span(SWAP, direction="in", tokens=len(swapped.tokens)):
            cache = self.device.write_slot(cache, slot, swapped.kv)
        self.counters.swapped_in += 1
        return cache, list(swapped.tokens)

    def restore_blocks(self, cache: KVCache, session: Session, blocks: list[int]) -> KVCache:
        """Paged layout: write `session`'s host copy back into `blocks` (the first of the
        new blocks its next turn got, as many as hold the positions it reuses) and forget the
        copy."""
        swapped = session.swapped
        assert swapped is not None
        self.swap.drop(session)
        if blocks:
            with perf.span(SWAP, direction="in", tokens=len(swapped.tokens)):
                cache = self.device.write_blocks(cache, blocks, swapped.kv)
            self.counters.swapped_in += 1
        return cache

    def flush(self, cache: KVCache) -> KVCache:
        """Run the parking moves planned so far as one device call."""
        outs, ins = self.parking.take_moves()
        assert self.pool is not None
        with perf.span(PARK, out=len(outs), back=len(ins)):
            cache, self.pool = self.device.park(cache, self.pool, outs, ins)
        return cache

    def settle(self, *, wait: bool = False) -> None:
        """Take host copies that have arrived off the device (`HostSwap.settle`)."""
        if self.swap.copying:
            self.swap.settle(wait=wait)

    def drop(self, session: Session) -> None:
        """Forget `session`'s kept cache, wherever it is."""
        self.swap.drop(session)
        self.parking.drop(session)

    def clear(self) -> None:
        """Forget every kept cache (they were computed by weights now replaced)."""
        self.swap.clear()
        self.parking.clear()

    def reset(self) -> None:
        """After a device failure: forget what the failed calls may have touched (host copies
        in flight, the whole parking cache, which may have been donated)."""
        self.swap.drop_copying()
        self.parking.clear()
        if self.pool is not None:
            self.pool = self.device.new_pool()


__all__ = ["PARK", "SWAP", "EvictedCaches", "HostSwap", "Parking"]
