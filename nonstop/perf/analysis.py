"""Derived figures from recorded events: where time went, per role and per stage, over a window.

- busy fraction of a role: the union of its `<role>/device_busy` intervals over the window;
- idle fraction and its cause: the rest of the window, attributed to the role's named waits in
  priority order (the first cause covering an idle instant gets it; what none covers is
  `unattributed`), so the causes and `unattributed` add up to the idle fraction exactly;
- per-stage statistics: count, total and percentile durations, occupancy (fraction of the window
  at least one span of the stage was open) and concurrency (mean number open);
- rates of counters (tokens/s, episodes/s), gauge summaries (time-weighted queue depths), the
  staleness histogram, and model FLOPs utilisation when the device peak is known.

Windows are `(start_ns, end_ns)` on the run's anchor clock, both ends inclusive; spans are clipped
to the window. `summarize` bundles everything; the flusher writes it as scalars and the run
report builds on it.
"""

import dataclasses
import math
from collections.abc import Iterable, Sequence

from nonstop.perf import stages
from nonstop.perf.events import Event

Interval = tuple[int, int]
Window = tuple[int, int]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of half-open intervals; empty ones are dropped."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def clip(intervals: Iterable[Interval], window: Window) -> list[Interval]:
    lo, hi = window
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def length(intervals: Iterable[Interval]) -> int:
    return sum(b - a for a, b in intervals)


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """`a` minus `b`, both merged."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def window_of(events: Sequence[Event]) -> Window:
    """The smallest window holding every event."""
    if not events:
        return (0, 0)
    return (min(e.t0 for e in events), max(e.t1 for e in events))


def _spans(events: Iterable[Event], names: set[str]) -> list[Interval]:
    return [(e.t0, e.t1) for e in events if e.ph == "X" and e.name in names]


def busy_intervals(events: Sequence[Event], role: str, window: Window) -> list[Interval]:
    return merge(clip(_spans(events, {stages.device_busy_name(role)}), window))


def busy_fraction(events: Sequence[Event], role: str, window: Window | None = None) -> float:
    """Fraction of the window `role`'s device was busy (e.g. the engine busy fraction)."""
    window = window or window_of(events)
    span = window[1] - window[0]
    return length(busy_intervals(events, role, window)) / span if span > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class IdleBreakdown:
    """A role's idle time over a window, as fractions of the window, by cause."""

    role: str
    busy: float
    idle: float
    causes: dict[str, float]  # stage name → fraction of the window it explains
    unattributed: float


def idle_breakdown(
    events: Sequence[Event],
    role: str,
    window: Window | None = None,
    causes: Sequence[str] | None = None,
) -> IdleBreakdown:
    """Where `role` was not device-busy, and which of `causes` (default: the role's waits, host
    work and other stages, most specific first) it was inside at the time."""
    window = window or window_of(events)
    span = window[1] - window[0]
    if span <= 0:
        return IdleBreakdown(role, 0.0, 0.0, {}, 0.0)
    busy = busy_intervals(events, role, window)
    if causes is None:
        causes = stages.idle_causes(role)
        seen = sorted(
            {
                e.name
                for e in events
                if e.ph == "X" and e.role == role and not stages.is_device_busy(e.name)
            }
            - set(causes)
        )
        causes = [*causes, *seen]
    remaining = subtract([window], busy)
    idle = length(remaining)
    explained: dict[str, float] = {}
    for name in causes:
        cover = merge(clip(_spans(events, {name}), window))
        left = subtract(remaining, cover)
        got = length(remaining) - length(left)
        if got:
            explained[name] = got / span
        remaining = left
    return IdleBreakdown(role, 1 - idle / span, idle / span, explained, length(remaining) / span)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) of already sorted values."""
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclasses.dataclass(frozen=True)
class StageStats:
    """Spans of one name overlapping a window; durations in seconds."""

    name: str
    role: str
    count: int
    total_s: float  # summed duration, clipped to the window
    mean_s: float  # of whole spans
    p50_s: float
    p99_s: float
    max_s: float
    occupancy: float  # fraction of the window at least one was open
    concurrency: float  # mean number open


def stage_stats(events: Sequence[Event], window: Window | None = None) -> dict[str, StageStats]:
    window = window or window_of(events)
    span = max(window[1] - window[0], 1)
    by_name: dict[str, list[Event]] = {}
    for e in events:
        if e.ph == "X" and e.t1 >= window[0] and e.t0 <= window[1]:
            by_name.setdefault(e.name, []).append(e)
    out = {}
    for name, evs in sorted(by_name.items()):
        intervals = [(e.t0, e.t1) for e in evs]
        clipped = clip(intervals, window)
        durations = sorted(e.duration_ns / 1e9 for e in evs)
        out[name] = StageStats(
            name=name,
            role=evs[0].role,
            count=len(evs),
            total_s=length(clipped) / 1e9,
            mean_s=sum(durations) / len(durations),
            p50_s=_quantile(durations, 0.5),
            p99_s=_quantile(durations, 0.99),
            max_s=durations[-1],
            occupancy=length(merge(clipped)) / span,
            concurrency=length(clipped) / span,
        )
    return out


def rate(events: Sequence[Event], name: str, window: Window | None = None) -> float:
    """Counter `name` summed over the window, per second (tokens/s, episodes/s)."""
    window = window or window_of(events)
    span = window[1] - window[0]
    if span <= 0:
        return 0.0
    lo, hi = window
    total = sum(e.value for e in events if e.ph == "C" and e.name == name and lo <= e.t0 <= hi)
    return total / (span / 1e9)


@dataclasses.dataclass(frozen=True)
class GaugeStats:
    """Samples of one gauge in a window; `time_mean` weights each value by how long it held."""

    name: str
    count: int
    mean: float
    time_mean: float
    min: float
    p50: float
    p99: float
    max: float
    last: float


def gauge_stats(events: Sequence[Event], window: Window | None = None) -> dict[str, GaugeStats]:
    window = window or window_of(events)
    lo, hi = window
    by_name: dict[str, list[Event]] = {}
    for e in events:
        if e.ph == "G":
            by_name.setdefault(e.name, []).append(e)
    out = {}
    for name, evs in sorted(by_name.items()):
        evs.sort(key=lambda e: e.t0)
        inside = [e for e in evs if lo <= e.t0 <= hi]
        if not inside:
            continue
        before = [e for e in evs if e.t0 < lo]
        # The value holding at each instant: the last sample before it (or the first sample).
        held = ([(lo, before[-1].value)] if before else []) + [(e.t0, e.value) for e in inside]
        weighted = sum(
            v * (t_next - t) for (t, v), (t_next, _) in zip(held, held[1:], strict=False)
        )
        weighted += held[-1][1] * (hi - held[-1][0])
        covered = hi - held[0][0]
        values = sorted(e.value for e in inside)
        out[name] = GaugeStats(
            name=name,
            count=len(values),
            mean=sum(values) / len(values),
            time_mean=weighted / covered if covered > 0 else inside[-1].value,
            min=values[0],
            p50=_quantile(values, 0.5),
            p99=_quantile(values, 0.99),
            max=values[-1],
            last=inside[-1].value,
        )
    return out


def histogram(
    events: Sequence[Event], name: str = stages.TRAIN_STALENESS, window: Window | None = None
) -> dict[float, int]:
    """How many samples of gauge `name` took each value (the staleness distribution)."""
    lo, hi = window or window_of(events)
    counts: dict[float, int] = {}
    for e in events:
        if e.ph == "G" and e.name == name and lo <= e.t0 <= hi:
            counts[e.value] = counts.get(e.value, 0) + 1
    return dict(sorted(counts.items()))


def mfu(
    events: Sequence[Event],
    peak_flops_per_s: float,
    window: Window | None = None,
    flops: str = stages.TRAIN_FLOPS,
) -> float:
    """Model FLOPs utilisation: counted model FLOPs per second over the window / device peak."""
    return rate(events, flops, window) / peak_flops_per_s


@dataclasses.dataclass(frozen=True)
class Figures:
    """Every derived figure for one window."""

    window_s: float
    busy: dict[str, float]  # role → device-busy fraction, for roles that record device_busy
    idle: dict[str, IdleBreakdown]
    stages: dict[str, StageStats]
    rates: dict[str, float]  # counter → per second
    gauges: dict[str, GaugeStats]
    staleness: dict[float, int]
    mfu: float | None
    dropped: int

    def scalars(self) -> dict[str, float]:
        """Flat `name → value` for TensorBoard and Prometheus."""
        out: dict[str, float] = {"perf/window_s": self.window_s, "perf/dropped": self.dropped}
        for role, value in self.busy.items():
            out[f"busy/{role}"] = value
        for role, idle in self.idle.items():
            out[f"idle/{role}"] = idle.idle
            out[f"idle/{role}/unattributed"] = idle.unattributed
            for cause, value in idle.causes.items():
                out[f"idle/{role}/{cause}"] = value
        for name, st in self.stages.items():
            out[f"stage/{name}/count"] = st.count
            out[f"stage/{name}/mean_ms"] = st.mean_s * 1e3
            out[f"stage/{name}/p99_ms"] = st.p99_s * 1e3
            out[f"stage/{name}/occupancy"] = st.occupancy
        for name, value in self.rates.items():
            out[f"rate/{name}_per_s"] = value
        for name, g in self.gauges.items():
            out[f"gauge/{name}/time_mean"] = g.time_mean
            out[f"gauge/{name}/max"] = g.max
        if self.staleness:
            n = sum(self.staleness.values())
            out["staleness/mean"] = sum(v * c for v, c in self.staleness.items()) / n
            out["staleness/max"] = max(self.staleness)
        if self.mfu is not None:
            out["mfu"] = self.mfu
        return out


def summarize(
    events: Sequence[Event],
    window: Window | None = None,
    peak_flops_per_s: float | None = None,
    dropped: int = 0,
) -> Figures:
    window = window or window_of(events)
    roles = sorted({e.role for e in events if e.ph == "X" and stages.is_device_busy(e.name)})
    counters = sorted({e.name for e in events if e.ph == "C"})
    has_flops = any(e.ph == "C" and e.name == stages.TRAIN_FLOPS for e in events)
    return Figures(
        window_s=(window[1] - window[0]) / 1e9,
        busy={r: busy_fraction(events, r, window) for r in roles},
        idle={r: idle_breakdown(events, r, window) for r in roles},
        stages=stage_stats(events, window),
        rates={name: rate(events, name, window) for name in counters},
        gauges=gauge_stats(events, window),
        staleness=histogram(events, stages.TRAIN_STALENESS, window),
        mfu=mfu(events, peak_flops_per_s, window) if peak_flops_per_s and has_flops else None,
        dropped=dropped,
    )
