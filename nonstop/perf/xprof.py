"""Capture an XProf (jax.profiler) device trace for chosen steps, driven by the step spans.

    perf.capture_steps({10, 11}, run_dir / "xprof")
    for step in range(n):
        with perf.span(perf.TRAIN_STEP, step=step):   # trace starts entering step 10,
            state, metrics = train_step(state, batch)   # stops leaving step 11
            jax.block_until_ready(metrics)

The capture watches spans named `stage` (default `train/step`) whose `step` tag is one of
`steps`: `jax.profiler.start_trace(logdir)` when the first of a run of consecutive chosen steps
opens, `stop_trace()` when the last one closes, so `{10, 11, 50}` gives two captures. With
`PerfConfig(annotate_jax=True)` every span is also a `TraceAnnotation`, so the capture shows the
same stage names as the always-on timeline. Once every chosen step is captured the watcher
removes itself. jax is imported only when a capture starts.
"""

import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from nonstop.perf import stages
from nonstop.perf.recorder import STATE


class StepCapture:
    """Starts and stops `jax.profiler` traces at the boundaries of chosen step spans."""

    def __init__(self, steps: Iterable[int], logdir: str, stage: str = stages.TRAIN_STEP) -> None:
        self.steps = frozenset(int(s) for s in steps)
        if not self.steps:
            raise ValueError("capture_steps: steps is empty; valid: one or more step numbers")
        self.logdir = os.fspath(logdir)
        self.stage = stage
        self.captured: list[int] = []  # chosen steps whose spans closed inside a capture
        self.sessions = 0  # traces written
        self.active = False
        self._lock = threading.Lock()

    def on_enter(self, name: str, tags: Mapping[str, Any]) -> None:
        if name != self.stage:
            return
        step = tags.get(stages.TAG_STEP)
        if step is None or int(step) not in self.steps:
            return
        with self._lock:
            if not self.active:
                import jax

                os.makedirs(self.logdir, exist_ok=True)
                jax.profiler.start_trace(self.logdir)
                self.active = True

    def on_exit(self, name: str, tags: Mapping[str, Any]) -> None:
        if name != self.stage:
            return
        step = tags.get(stages.TAG_STEP)
        if step is None or int(step) not in self.steps:
            return
        with self._lock:
            if not self.active:
                return
            self.captured.append(int(step))
            if int(step) + 1 not in self.steps:
                self._stop()
            if int(step) >= max(self.steps) and STATE.capture is self:
                STATE.capture = None

    def _stop(self) -> None:
        import jax

        jax.profiler.stop_trace()
        self.active = False
        self.sessions += 1

    def close(self) -> None:
        """Stop a capture in progress and stop watching spans."""
        with self._lock:
            if self.active:
                self._stop()
            if STATE.capture is self:
                STATE.capture = None


def capture_steps(
    steps: Iterable[int], logdir: str | os.PathLike, stage: str = stages.TRAIN_STEP
) -> StepCapture:
    """Capture an XProf trace into `logdir` for each of `steps` (see the module docstring)."""
    if STATE.capture is not None and STATE.capture.active:
        raise RuntimeError("capture_steps: a capture is in progress; close() it first")
    capture = StepCapture(steps, os.fspath(logdir), stage)
    STATE.capture = capture
    return capture
