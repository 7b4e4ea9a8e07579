"""The recorder: a bounded ring of events, a clock anchor, and the run that streams them to disk.

There is always a current recorder. Without a run directory it is an in-memory ring of
`capacity` events (the oldest are dropped, and counted, once it is full), so instrumented code
costs the same whether or not anyone listens. `start_run(run_dir)` replaces it with one whose
background flusher thread drains the ring every `flush_interval_s` into `run_dir/events.jsonl`
(whole lines, flushed per batch: a crash loses at most the last interval and leaves at most one
half line), writes derived figures as TensorBoard scalars and `perf_metrics.jsonl` every
`scalars_every_s`, and on `finish_run()` writes the end marker and the Perfetto trace
`run_dir/trace.json`.

The hot path only takes a lock and appends a tuple; JSON encoding, role lookup and thread names
happen on the flusher thread.
"""

import atexit
import collections
import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from nonstop.perf import stages
from nonstop.perf.events import FORMAT_VERSION, Event, RawEvent, encode_line, event_from_raw

_log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
TRACE_FILE = "trace.json"
METRICS_FILE = "perf_metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerfConfig:
    """How the always-on profiler records and what it writes into a run directory."""

    enabled: bool = True  # False: spans, counters and gauges record nothing
    capacity: int = 65536  # events the ring holds before the oldest are dropped
    flush_interval_s: float = 0.2  # how often the flusher drains the ring into events.jsonl
    annotate_jax: bool = False  # also enter jax.profiler.TraceAnnotation(name) in every span
    write_trace: bool = True  # write run_dir/trace.json (Perfetto) at finish_run()
    tensorboard: bool = True  # write derived figures as TensorBoard scalars
    scalars_every_s: float = 10.0  # window of the derived figures written while running
    peak_flops_per_s: float | None = None  # device peak, for model FLOPs utilisation
    prometheus_port: int | None = None  # serve /metrics on this port while a run is active

    def __post_init__(self) -> None:
        _check(isinstance(self.capacity, int) and self.capacity >= 16, "capacity", self.capacity,
               "an int >= 16")
        for field in ("flush_interval_s", "scalars_every_s"):
            value = getattr(self, field)
            _check(value > 0, field, value, "a number of seconds > 0")
        _check(self.peak_flops_per_s is None or self.peak_flops_per_s > 0, "peak_flops_per_s",
               self.peak_flops_per_s, "None (no MFU) or a float > 0")
        port = self.prometheus_port
        _check(port is None or 0 <= port < 65536, "prometheus_port", port,
               "None (no /metrics) or an int in [0, 65535]")


def _check(ok: bool, field: str, value: Any, valid: str) -> None:
    """`nonstop.models.validation.check` for PerfConfig, imported only to raise: importing
    nonstop.models pulls in jax, and importing perf must not."""
    if not ok:
        from nonstop.models.validation import invalid

        raise invalid("PerfConfig", field, value, valid)


@dataclasses.dataclass
class Totals:
    """Running totals since the run started, kept by the flusher (for Prometheus)."""

    counters: dict[str, float] = dataclasses.field(default_factory=dict)
    gauges: dict[str, float] = dataclasses.field(default_factory=dict)
    span_count: dict[str, int] = dataclasses.field(default_factory=dict)
    span_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, event: Event) -> None:
        if event.ph == "X":
            self.span_count[event.name] = self.span_count.get(event.name, 0) + 1
            self.span_seconds[event.name] = (
                self.span_seconds.get(event.name, 0.0) + event.duration_ns / 1e9
            )
        elif event.ph == "C":
            self.counters[event.name] = self.counters.get(event.name, 0.0) + event.value
        elif event.ph == "G":
            self.gauges[event.name] = event.value


class Recorder:
    """A fixed-capacity ring of raw events plus the clock anchor they are measured against."""

    def __init__(self, config: PerfConfig) -> None:
        self.config = config
        self.enabled = config.enabled
        self.anchor_perf_ns = time.perf_counter_ns()
        self.anchor_wall_ns = time.time_ns()
        self.annotation: Any = None  # jax.profiler.TraceAnnotation when annotate_jax
        if config.annotate_jax and config.enabled:
            from jax.profiler import TraceAnnotation  # lazy: nonstop.perf never forces jax in

            self.annotation = TraceAnnotation
        self.dropped = 0
        self._capacity = config.capacity
        self._ring: collections.deque[RawEvent] = collections.deque(maxlen=config.capacity)
        self._lock = threading.Lock()
        # Thread names taken by each thread at its first event: a thread that ends before the
        # flusher drains its events keeps its name. Thread-local, so a reused ident re-registers.
        self._named = threading.local()
        self.thread_names: dict[int, str] = {}

    def append(self, head: RawEvent, tags: dict[str, Any]) -> None:
        """Buffer one event: its 11 fixed fields, then its tags flattened (`RawEvent`)."""
        raw = head + (*tags, *tags.values()) if tags else head
        if not getattr(self._named, "done", False):
            self._named.done = True
            self.thread_names[head[6]] = threading.current_thread().name
        with self._lock:
            if len(self._ring) == self._capacity:
                self.dropped += 1
            self._ring.append(raw)

    def drain(self) -> list[RawEvent]:
        """Take every buffered event out of the ring, oldest first."""
        with self._lock:
            out = list(self._ring)
            self._ring.clear()
        return out

    def to_event(self, raw: RawEvent) -> Event:
        return event_from_raw(raw, raw[2] or stages.role_of(raw[1]), self.anchor_perf_ns)

    def events(self) -> list[Event]:
        """A copy of the events still in the ring (not yet flushed), oldest first."""
        with self._lock:
            raws = list(self._ring)
        return [self.to_event(r) for r in raws]

    def meta(self) -> dict[str, Any]:
        return {
            "ph": "M",
            "format": FORMAT_VERSION,
            "anchor_perf_ns": self.anchor_perf_ns,
            "anchor_wall_ns": self.anchor_wall_ns,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "capacity": self._capacity,
        }


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """What a finished run wrote."""

    run_dir: str
    events: str
    trace: str | None
    metrics: str
    tensorboard: str | None
    written: int  # events written to events.jsonl
    dropped: int  # events lost to a full ring


class _Run(threading.Thread):
    """The flusher: drains the ring into events.jsonl and writes periodic derived figures."""

    def __init__(self, recorder: Recorder, run_dir: str) -> None:
        super().__init__(name="nonstop-perf-flusher", daemon=True)
        from nonstop.perf.scalars import ScalarWriter

        self.recorder = recorder
        self.run_dir = run_dir
        self.events_path = os.path.join(run_dir, EVENTS_FILE)
        os.makedirs(run_dir, exist_ok=True)
        _set_aside(self.events_path)
        self._file = open(self.events_path, "w", encoding="utf-8")
        self._file.write(encode_line(recorder.meta()))
        self._file.flush()
        cfg = recorder.config
        tb_dir = os.path.join(run_dir, TENSORBOARD_DIR) if cfg.tensorboard else None
        self.scalars = ScalarWriter(os.path.join(run_dir, METRICS_FILE), tb_dir)
        self.tensorboard_dir = tb_dir
        self.totals = Totals()
        self.written = 0
        self._halt = threading.Event()
        self._threads: dict[int, str] = {}
        self._reported_dropped = 0
        self._window: list[Event] = []
        self._window_start = 0
        self._window_index = 0
        self._drained_to = 0  # ns since the anchor when the last drain began
        self._last_scalars = time.perf_counter_ns()

    def run(self) -> None:
        while not self._halt.wait(self.recorder.config.flush_interval_s):
            try:
                self.flush()
                now = time.perf_counter_ns()
                if (now - self._last_scalars) / 1e9 >= self.recorder.config.scalars_every_s:
                    self.write_scalars()
                    self._last_scalars = now
            except Exception:  # profiling must never take the run down; the ring stays bounded
                _log.exception("nonstop.perf flusher failed; retrying next interval")

    def flush(self) -> None:
        self._drained_to = time.perf_counter_ns() - self.recorder.anchor_perf_ns
        raws = self.recorder.drain()
        lines = []
        for raw in raws:
            tid = raw[6]
            name = self.recorder.thread_names[tid]  # registered by its first append
            if self._threads.get(tid) != name:  # a new thread, or a new one on a reused ident
                self._threads[tid] = name
                lines.append(encode_line({"ph": "T", "tid": tid, "name": name}))
            event = self.recorder.to_event(raw)
            self.totals.add(event)
            if event.ph == "C" and event.t0 < self._window_start:
                # Counted after its window's figures were written (the thread was between
                # reading the clock and recording): it counts in this window, at its start.
                self._window.append(dataclasses.replace(event, t0=self._window_start,
                                                        t1=self._window_start))
            else:
                self._window.append(event)
            lines.append(encode_line(event.to_json()))
        dropped = self.recorder.dropped
        if dropped != self._reported_dropped:
            t = time.perf_counter_ns() - self.recorder.anchor_perf_ns
            lines.append(encode_line({"ph": "D", "t": t, "dropped": dropped}))
            self._reported_dropped = dropped
        if lines:
            self._file.write("".join(lines))
            self._file.flush()
            self.written += len(raws)

    def write_scalars(self) -> None:
        """Figures for the events drained since the last call, over the time up to the last
        drain: an event recorded after that drain falls in the next window, not in none."""
        from nonstop.perf.analysis import summarize

        window = (self._window_start, max(self._window_start, self._drained_to))
        figures = summarize(
            self._window,
            window=window,
            peak_flops_per_s=self.recorder.config.peak_flops_per_s,
            dropped=self.recorder.dropped,
        )
        self.scalars.write(figures, step=self._window_index, wall_time=time.time())
        self._window = []
        self._window_start = window[1]
        self._window_index += 1

    def finish(self) -> RunFiles:
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()
        self.flush()
        self.write_scalars()
        t = time.perf_counter_ns() - self.recorder.anchor_perf_ns
        end = {"ph": "E", "t": t, "dropped": self.recorder.dropped, "events": self.written}
        self._file.write(encode_line(end))
        self._file.close()
        self.scalars.close()
        trace_path = None
        if self.recorder.config.write_trace:
            from nonstop.perf.trace import write_trace

            trace_path = os.path.join(self.run_dir, TRACE_FILE)
            write_trace(self.events_path, trace_path)
        return RunFiles(
            run_dir=self.run_dir,
            events=self.events_path,
            trace=trace_path,
            metrics=self.scalars.metrics_path,
            tensorboard=self.tensorboard_dir,
            written=self.written,
            dropped=self.recorder.dropped,
        )


def _set_aside(path: str) -> None:
    """Keep an earlier run's events (a resumed run reuses its directory) as events.<k>.jsonl."""
    if not os.path.exists(path):
        return
    stem, ext = os.path.splitext(path)
    k = 1
    while os.path.exists(f"{stem}.{k}{ext}"):
        k += 1
    os.replace(path, f"{stem}.{k}{ext}")


class _State:
    """The process-wide current recorder, and the run streaming it, if any."""

    def __init__(self) -> None:
        self.base_config = PerfConfig()
        self.recorder = Recorder(self.base_config)
        self.run: _Run | None = None
        self.prometheus: Any = None
        self.capture: Any = None  # an xprof.StepCapture watching span boundaries, if any
        self.lock = threading.Lock()


STATE = _State()
_atexit_registered = False


def current() -> Recorder:
    """The recorder spans, counters and gauges write to right now."""
    return STATE.recorder


def configure(config: PerfConfig) -> Recorder:
    """Replace the in-memory recorder (no run directory) with one built from `config`."""
    with STATE.lock:
        if STATE.run is not None:
            raise RuntimeError("perf.configure: a run is active; call perf.finish_run() first")
        STATE.base_config = config
        STATE.recorder = Recorder(config)
        return STATE.recorder


def start_run(run_dir: str | os.PathLike, config: PerfConfig | None = None) -> Recorder:
    """Start streaming events into `run_dir`; `config` defaults to the configured one."""
    global _atexit_registered
    with STATE.lock:
        if STATE.run is not None:
            raise RuntimeError(
                f"perf.start_run({os.fspath(run_dir)!r}): a run into {STATE.run.run_dir!r} is "
                "already active; call perf.finish_run() first"
            )
        recorder = Recorder(config or STATE.base_config)
        run = _Run(recorder, os.fspath(run_dir))
        run.start()
        STATE.recorder, STATE.run = recorder, run
        if recorder.config.prometheus_port is not None:
            from nonstop.perf.scalars import PrometheusExporter

            STATE.prometheus = PrometheusExporter(run.totals, recorder, recorder.config)
        if not _atexit_registered:
            atexit.register(_finish_at_exit)
            _atexit_registered = True
        return recorder


def finish_run() -> RunFiles:
    """Flush, write the end marker, the trace and the last scalars; back to an in-memory ring."""
    with STATE.lock:
        run = STATE.run
        if run is None:
            raise RuntimeError("perf.finish_run: no run is active")
        STATE.recorder = Recorder(STATE.base_config)
        STATE.run = None
        if STATE.prometheus is not None:
            STATE.prometheus.close()
            STATE.prometheus = None
    return run.finish()


@contextlib.contextmanager
def run(run_dir: str | os.PathLike, config: PerfConfig | None = None) -> Iterator[Recorder]:
    """`with perf.run(run_dir): …` — start_run on entry, finish_run on exit (also on error)."""
    recorder = start_run(run_dir, config)
    try:
        yield recorder
    finally:
        finish_run()


def active_run_dir() -> str | None:
    run_ = STATE.run
    return None if run_ is None else run_.run_dir


def _finish_at_exit() -> None:
    if STATE.run is not None:
        finish_run()
