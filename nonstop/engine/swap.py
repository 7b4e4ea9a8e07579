"""Host swap space: the KV caches of evicted sessions, kept on the host within a byte budget
(`EngineConfig.swap_space_gib`) so a session's next turn prefills only its new tokens.

The scheduler thread copies a slot's keys and values out when it evicts an idle session and
hands them to `HostSwap.store`; the least recently evicted copies are dropped first to make
room. Only the scheduler thread touches it.
"""

from __future__ import annotations

import collections

from nonstop.engine.requests import Counters, Session, SwappedCache


class HostSwap:
    """Evicted sessions' caches on the host, least recently evicted first."""

    def __init__(self, budget_bytes: int, counters: Counters) -> None:
        self.budget = budget_bytes
        self.bytes = 0
        self.sessions: collections.OrderedDict[Session, None] = collections.OrderedDict()
        self.counters = counters

    def fits(self, nbytes: int) -> bool:
        """Whether a copy of `nbytes` can be kept at all (0 bytes: nothing to keep)."""
        return 0 < nbytes <= self.budget

    def make_room(self, nbytes: int) -> None:
        """Drop the least recently evicted copies until `nbytes` more fit."""
        while self.bytes + nbytes > self.budget:
            self.drop(next(iter(self.sessions)))
            self.counters.swap_dropped += 1

    def store(self, session: Session, cache: SwappedCache) -> None:
        session.swapped = cache
        self.sessions[session] = None
        self.bytes += cache.nbytes
        self.counters.swapped_out += 1

    def drop(self, session: Session) -> None:
        """Forget `session`'s host copy, if it has one."""
        if session.swapped is not None:
            self.bytes -= session.swapped.nbytes
            session.swapped = None
            del self.sessions[session]

    def clear(self) -> None:
        for session in list(self.sessions):
            self.drop(session)


__all__ = ["HostSwap"]
