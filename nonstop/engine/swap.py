"""Host swap space: the KV caches of evicted sessions, kept on the host within a byte budget
(`EngineConfig.swap_space_gib`) so a session's next turn prefills only its new tokens.

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

from nonstop import perf
from nonstop.engine.device import DeviceSteps
from nonstop.engine.requests import Counters, Session, SwappedCache
from nonstop.models.decoder import KVCache

SWAP = "engine/swap"  # span: an evicted session's cache copied to the host, or back


class HostSwap:
    """Evicted sessions' caches on the host, least recently evicted first."""

    def __init__(self, budget_bytes: int, counters: Counters) -> None:
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
                cache, kv=DeviceSteps.slot_to_host(cache.kv, len(cache.tokens)), on_host=True)
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


__all__ = ["SWAP", "HostSwap"]
