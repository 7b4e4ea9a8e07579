"""`InFlight`: the device calls the scheduler has launched and not yet read back.

Calls (decode steps and prefills) are kept in launch order, which is the order the device runs
them in, and read back in that order. After each decode launch the scheduler reads back every
call before the last `pipeline_depth - 1` decode steps, so the device runs that many steps
ahead of the host's bookkeeping; when nothing new is launched, everything is read back.

It also keeps the device's busy accounting (`perf.device_busy_interval`), conservatively: a
call counts as busy from when it could start (launched, and the call before it known done) to
when the host saw it finish; if it had finished before the host looked, only up to when the
host last saw it running, which the host notes before each launch and after each read-back.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator

from nonstop import perf
from nonstop.engine.requests import LaunchedStep


class InFlight:
    """The launched, unread calls of one scheduler, with `depth` decode steps kept running."""

    def __init__(self, depth: int) -> None:
        self.calls: collections.deque[LaunchedStep] = collections.deque()
        # The last `depth - 1` decode steps launched: left running, unread.
        self._ahead: collections.deque[LaunchedStep] = collections.deque(maxlen=depth - 1)
        self._device_free_ns = 0  # when the last call read back was known to be done

    def __bool__(self) -> bool:
        return bool(self.calls)

    def launch_time(self) -> int:
        """Just before a launch: note whether the last call is still running, and return the
        launch's time (ns) for its `LaunchedStep`."""
        self.note_running()
        return time.perf_counter_ns()

    def add(self, step: LaunchedStep, *, decode: bool) -> None:
        self.calls.append(step)
        if decode:
            self._ahead.append(step)

    def due(self, *, launched_decode: bool) -> Iterator[LaunchedStep]:
        """Take off, oldest first, the calls to read back now: those before the decode steps
        kept running (all of them if this pass launched no decode step)."""
        if not launched_decode:
            self._ahead.clear()
        oldest_kept = self._ahead[0] if self._ahead else None
        while self.calls and self.calls[0] is not oldest_kept:
            yield self.calls.popleft()

    def note_running(self) -> None:
        """If the last call launched is still running, note when it was seen so."""
        if self.calls:
            last = self.calls[-1]
            if not last.out.tokens.is_ready():
                last.seen_running_ns = time.perf_counter_ns()

    def record_busy(self, step: LaunchedStep, *, was_running: bool) -> None:
        """Record `step`'s busy interval once it is read back (`was_running`: it was not yet
        done when the read-back began)."""
        if was_running:
            done_ns = time.perf_counter_ns()
        else:
            done_ns = step.seen_running_ns if step.seen_running_ns is not None else 0
        start_ns = max(step.launched_ns, self._device_free_ns)
        perf.device_busy_interval(perf.ENGINE, start_ns, done_ns)
        self._device_free_ns = max(done_ns, start_ns)

    def clear(self) -> None:
        """Forget every call (the device failed)."""
        self.calls.clear()
        self._ahead.clear()
