"""The run report: where a run's time went, who waited on whom, and what to change.

    report = build_report(run_dir)          # from events.jsonl alone; trace.json is optional
    print(report.text())                    # or report.to_json()

Attribution. Each role that records device-busy intervals (engine, trainer) has the run's
window split, with nothing counted twice, into
- *busy*, split by the stage span it happened in (`rollout/decode`, `train/step`, …);
- *idle, by named cause*, taken in priority order: before the role's first event ("not started")
  or after its last ("finished"); then what the role's own threads were inside (its waits, host
  work and stages — including spans of other roles recorded on the same thread, like a batch
  learner's collection); then what the rest of the pipeline was doing that leaves the role with
  nothing to do (an idle engine while episodes wait on tools, rewards or a weight sync);
- *unattributed*: idle time no recorded span explains.
Episodes (the rollout role's asyncio tasks, or threads) are attributed per episode lifetime,
first to last span of the track, by the stage each instant was in.

Advice comes from a few fixed rules over these figures (thresholds below), each saying which
figure triggered it.
"""

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from nonstop.perf import stages
from nonstop.perf.analysis import (
    GaugeStats,
    Interval,
    StageStats,
    Window,
    clip,
    gauge_stats,
    histogram,
    length,
    merge,
    mfu,
    rate,
    stage_stats,
    subtract,
    window_of,
)
from nonstop.perf.events import Event, EventLog, read_events
from nonstop.perf.recorder import EVENTS_FILE, METRICS_FILE, TENSORBOARD_DIR, TRACE_FILE

BEFORE_START = "(not started)"
AFTER_END = "(finished)"
GENERATE = stages.ROLLOUT_GENERATE  # an episode awaiting the engine (the Agent spans each turn)

# What a cause means for the role it explains: its own stage, or another role's (cross).
_OWN_LABELS = {
    stages.TRAIN_DATA_WAIT: "waiting for groups",
    stages.TRAIN_WEIGHT_SYNC: "syncing weights",
    stages.TRAIN_CHECKPOINT: "checkpointing",
    stages.TRAIN_EVAL: "evaluating",
    stages.TRAIN_STEP: "host work in the step",
    stages.ROLLOUT_PREFILL: "host work around prefill",
    stages.ROLLOUT_DECODE: "host work around decode",
    stages.ROLLOUT_QUEUE_WAIT: "waiting for episodes",
    stages.ROLLOUT_REWARD: "computing rewards",
    stages.ROLLOUT_TOOL_WAIT: "waiting on tools",
    stages.ROLLOUT_ENV: "in the environment",
    "engine/weight_update": "applying new weights",
    BEFORE_START: "not started yet",
    AFTER_END: "finished",
}
_CROSS_LABELS = {
    stages.ROLLOUT_TOOL_WAIT: "no requests: episodes waiting on tools",
    stages.ROLLOUT_REWARD: "no requests: episodes being scored",
    stages.ROLLOUT_ENV: "no requests: episodes in the environment",
    stages.ROLLOUT_QUEUE_WAIT: "no requests: episodes queued",
    stages.TRAIN_WEIGHT_SYNC: "waiting for a weight sync",
    stages.TRAINER_BUSY: "the trainer had the device",
    stages.ENGINE_BUSY: "the engine had the device",
}
# Other roles' stages that leave a role with nothing to do, most specific first.
CROSS_CAUSES: dict[str, tuple[str, ...]] = {
    stages.ENGINE: (
        stages.ROLLOUT_TOOL_WAIT,
        stages.ROLLOUT_REWARD,
        stages.ROLLOUT_ENV,
        stages.ROLLOUT_QUEUE_WAIT,
        stages.TRAIN_WEIGHT_SYNC,
        stages.TRAINER_BUSY,
    ),
    stages.TRAINER: (stages.ENGINE_BUSY,),
}
EPISODE_ORDER = (
    stages.ROLLOUT_TOOL_WAIT,
    stages.ROLLOUT_QUEUE_WAIT,
    stages.ROLLOUT_REWARD,
    GENERATE,
)  # then any other rollout span, then rollout/env (often the whole environment step)

# Advice thresholds (fractions).
NOTABLE = 0.05  # causes below this are left out of the sentences
STARVED = 0.30  # a trainer waiting this much for data is starved
SATURATED = 0.80  # a device busy this much is the bottleneck
TOOL_BOUND = 0.50  # episodes spending this much in tool waits are tool-bound
SYNC_HEAVY = 0.10  # weight sync taking this much of the trainer
UNEXPLAINED = 0.05  # unattributed time above this asks for more spans


def describe(cause: str, own: bool = True) -> str:
    """A cause key in words: `train/data_wait` → `waiting for groups (train/data_wait)`."""
    label = (_OWN_LABELS if own else _CROSS_LABELS).get(cause)
    if cause in (BEFORE_START, AFTER_END):
        return _OWN_LABELS[cause]
    return f"{label} ({cause})" if label else cause


@dataclasses.dataclass(frozen=True)
class RoleTime:
    """One role's share of the run window: fractions that add up to 1."""

    role: str
    window_s: float
    busy: float
    busy_in: dict[str, float]  # stage → busy fraction inside it; "(no stage)" for the rest
    idle: dict[str, float]  # cause → idle fraction it explains, in priority order
    cross: tuple[str, ...]  # causes in `idle` that are other roles' stages
    unattributed: float

    @property
    def attributed(self) -> float:
        return 1.0 - self.unattributed

    def cause_text(self, cause: str) -> str:
        return describe(cause, own=cause not in self.cross)


@dataclasses.dataclass(frozen=True)
class EpisodeTime:
    """The rollout tracks' lifetimes (first to last span), by the stage each instant was in."""

    count: int
    total_s: float
    mean_s: float
    causes: dict[str, float]  # stage → fraction of summed episode time
    unattributed: float


@dataclasses.dataclass(frozen=True)
class Report:
    run_dir: str
    window_s: float
    complete: bool
    problems: list[str]  # what is missing or could not be read
    files: dict[str, str]  # file → "ok (…)" or what is wrong with it
    roles: dict[str, RoleTime]
    episodes: EpisodeTime | None
    stages: dict[str, StageStats]
    rates: dict[str, float]  # counter → per second over the window
    totals: dict[str, float]  # counter → summed
    gauges: dict[str, GaugeStats]
    staleness: dict[float, int]
    mfu: float | None
    findings: list[str]  # who waited on whom
    advice: list[str]
    outcomes: dict[str, int] = dataclasses.field(default_factory=dict)  # episode status → count

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for role, rt in self.roles.items():
            out["roles"][role]["attributed"] = rt.attributed
        out["staleness"] = {str(k): v for k, v in self.staleness.items()}
        return out

    def text(self) -> str:
        return format_text(self)


def _spans(events: Sequence[Event], window: Window) -> dict[str, list[Interval]]:
    by_name: dict[str, list[Interval]] = {}
    for e in events:
        if e.ph == "X":
            by_name.setdefault(e.name, []).append((e.t0, e.t1))
    return {name: merge(clip(iv, window)) for name, iv in by_name.items()}


def _take(remaining: list[Interval], cover: list[Interval]) -> tuple[list[Interval], int]:
    left = subtract(remaining, cover)
    return left, length(remaining) - length(left)


def attribute_role(events: Sequence[Event], role: str, window: Window) -> RoleTime:
    """Split `window` for `role` into busy by stage, idle by named cause, and unattributed."""
    lo, hi = window
    span = max(hi - lo, 1)
    busy_name = stages.device_busy_name(role)
    busy_events = [e for e in events if e.ph == "X" and e.name == busy_name]
    threads = {e.tid for e in busy_events if e.task_key == 0}
    own = [
        e
        for e in events
        if e.ph == "X"
        and not stages.is_device_busy(e.name)
        and (e.role == role or (e.task_key == 0 and e.tid in threads))
    ]
    all_spans = _spans(events, window)
    own_spans = _spans(own, window)
    busy = all_spans.get(busy_name, [])

    busy_in: dict[str, float] = {}
    left = busy
    device_stages = [n for n, s in stages.STAGES.items() if s.role == role and s.kind == "device"]
    for name in device_stages + sorted(set(own_spans) - set(device_stages)):
        left, got = _take(left, own_spans.get(name, []))
        if got:
            busy_in[name] = got / span
    if length(left):
        busy_in["(no stage)"] = length(left) / span

    role_events = [e for e in events if e.role == role] + own
    first = min(e.t0 for e in role_events) if role_events else hi
    last = max(e.t1 for e in role_events) if role_events else hi
    causes: list[tuple[str, list[Interval]]] = [
        (BEFORE_START, [(lo, first)] if first > lo else []),
        (AFTER_END, [(last, hi)] if last < hi else []),
    ]
    ordered = stages.idle_causes(role)
    ordered += sorted(set(own_spans) - set(ordered))
    causes += [(name, own_spans[name]) for name in ordered if name in own_spans]
    cross = tuple(c for c in CROSS_CAUSES.get(role, ()) if c in all_spans)
    causes += [(name, all_spans[name]) for name in cross]

    idle: dict[str, float] = {}
    remaining = subtract([window], busy)
    for name, cover in causes:
        remaining, got = _take(remaining, cover)
        if got:
            idle[name] = idle.get(name, 0.0) + got / span
    return RoleTime(
        role=role,
        window_s=(hi - lo) / 1e9,
        busy=length(busy) / span,
        busy_in=busy_in,
        idle=idle,
        cross=tuple(c for c in cross if c in idle),
        unattributed=length(remaining) / span,
    )


def attribute_episodes(events: Sequence[Event]) -> EpisodeTime | None:
    """Per rollout track (episode task or thread), its lifetime split by stage; tracks of a
    thread that also records device-busy spans (a learner collecting) are not episodes."""
    device_threads = {
        e.tid for e in events if e.ph == "X" and stages.is_device_busy(e.name) and e.task_key == 0
    }
    tracks: dict[tuple[int, int, str | None], list[Event]] = {}
    for e in events:
        if e.ph == "X" and e.role == stages.ROLLOUT:
            if e.task_key == 0 and e.tid in device_threads:
                continue
            # The task's name too: the id of a finished task is reused by later ones.
            tracks.setdefault((e.tid, e.task_key, e.task), []).append(e)
    if not tracks:
        return None
    total = 0
    explained: dict[str, int] = {}
    unexplained = 0
    for evs in tracks.values():
        window = (min(e.t0 for e in evs), max(e.t1 for e in evs))
        total += window[1] - window[0]
        spans = _spans(evs, window)
        order = [n for n in EPISODE_ORDER if n in spans]
        order += sorted(set(spans) - set(order) - {stages.ROLLOUT_ENV})
        order += [stages.ROLLOUT_ENV] if stages.ROLLOUT_ENV in spans else []
        remaining = [window]
        for name in order:
            remaining, got = _take(remaining, spans[name])
            explained[name] = explained.get(name, 0) + got
        unexplained += length(remaining)
    denom = max(total, 1)
    causes = {k: v / denom for k, v in sorted(explained.items(), key=lambda kv: -kv[1]) if v}
    return EpisodeTime(
        count=len(tracks),
        total_s=total / 1e9,
        mean_s=total / 1e9 / len(tracks),
        causes=causes,
        unattributed=unexplained / denom,
    )


def _file_status(run_dir: str, log: EventLog) -> tuple[dict[str, str], list[str]]:
    from nonstop.perf.trace import TraceError, load_trace

    files: dict[str, str] = {}
    missing: list[str] = []
    events_path = os.path.join(run_dir, EVENTS_FILE)
    if os.path.exists(events_path):
        state = "complete" if log.complete else "incomplete: no end marker"
        files[EVENTS_FILE] = f"ok ({len(log.events)} events, {state})"
    else:
        files[EVENTS_FILE] = "missing"
    trace_path = os.path.join(run_dir, TRACE_FILE)
    if not os.path.exists(trace_path):
        files[TRACE_FILE] = "missing"
        missing.append(
            f"{TRACE_FILE}: missing (the run did not finish); `nonstop report --write-trace` "
            "rebuilds it from events.jsonl"
        )
    else:
        try:
            trace = load_trace(trace_path)
            n = sum(len(v) for v in trace.spans.values())
            files[TRACE_FILE] = f"ok (Perfetto; {n} spans; tracks: {', '.join(trace.roles)})"
        except TraceError as err:
            files[TRACE_FILE] = f"invalid: {err}"
            missing.append(f"{TRACE_FILE}: does not load: {err}")
    metrics_path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(metrics_path) or os.path.getsize(metrics_path) == 0:
        files[METRICS_FILE] = "missing" if not os.path.exists(metrics_path) else "empty"
        missing.append(f"{METRICS_FILE}: {files[METRICS_FILE]} (no scalar windows were written)")
    else:
        with open(metrics_path, encoding="utf-8") as f:
            files[METRICS_FILE] = f"ok ({sum(1 for _ in f)} windows)"
    tb = os.path.join(run_dir, TENSORBOARD_DIR)
    files[TENSORBOARD_DIR] = "ok" if os.path.isdir(tb) and os.listdir(tb) else "missing"
    if files[TENSORBOARD_DIR] == "missing":
        missing.append(f"{TENSORBOARD_DIR}/: missing (disabled, or the run died before a window)")
    return files, missing


def build_report(
    run_dir: str | os.PathLike,
    *,
    peak_flops_per_s: float | None = None,
    log: EventLog | None = None,
) -> Report:
    """Read `run_dir` (finished, crashed or half-written) and work out every figure it allows;
    `log` is its already read events.jsonl, if the caller has it."""
    run_dir = os.fspath(run_dir)
    log = log if log is not None else read_events(run_dir)
    files, missing = _file_status(run_dir, log)
    events = log.events
    window = window_of(events)
    roles = sorted(
        {e.role for e in events if e.ph == "X" and stages.is_device_busy(e.name)},
        key=lambda r: (r != stages.ENGINE, r != stages.TRAINER, r),
    )
    role_time = {r: attribute_role(events, r, window) for r in roles}
    counters = sorted({e.name for e in events if e.ph == "C"})
    has_flops = stages.TRAIN_FLOPS in counters
    report = Report(
        run_dir=run_dir,
        window_s=(window[1] - window[0]) / 1e9,
        complete=log.complete,
        problems=log.problems + missing,
        files=files,
        roles=role_time,
        episodes=attribute_episodes(events),
        stages=stage_stats(events, window) if events else {},
        rates={n: rate(events, n, window) for n in counters},
        totals={n: sum(e.value for e in events if e.ph == "C" and e.name == n) for n in counters},
        gauges=gauge_stats(events, window) if events else {},
        staleness=histogram(events, stages.TRAIN_STALENESS, window) if events else {},
        mfu=mfu(events, peak_flops_per_s, window) if peak_flops_per_s and has_flops else None,
        findings=[],
        advice=[],
        outcomes=episode_outcomes(events),
    )
    report.findings.extend(findings(report))
    report.advice.extend(advice(report, dropped=log.dropped))
    return report


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def findings(report: Report) -> list[str]:
    """Who waited on whom, in sentences, largest first."""
    out: list[str] = []
    for role, rt in report.roles.items():
        busy_stages = ", ".join(f"{k} {_pct(v)}" for k, v in rt.busy_in.items() if v >= NOTABLE)
        out.append(
            f"the {role} was busy {_pct(rt.busy)} of {rt.window_s:.3g} s"
            + (f" ({busy_stages})" if busy_stages else "")
        )
        for cause, value in sorted(rt.idle.items(), key=lambda kv: -kv[1]):
            if value < NOTABLE:
                continue
            if cause == BEFORE_START:
                out.append(f"the {role} had not started for the first {_pct(value)} of the run")
            elif cause == AFTER_END:
                out.append(f"the {role} had finished for the last {_pct(value)} of the run")
            elif cause == stages.TRAIN_DATA_WAIT:
                out.append(f"the {role} waited {_pct(value)} of the time for groups ({cause})")
            elif cause in rt.cross:
                out.append(f"the {role} was idle {_pct(value)} of the time: {rt.cause_text(cause)}")
            else:
                out.append(f"the {role} spent {_pct(value)} of the time {rt.cause_text(cause)}")
        if rt.unattributed >= NOTABLE:
            out.append(f"{_pct(rt.unattributed)} of the {role}'s time is explained by no span")
    ep = report.episodes
    if ep is not None:
        for cause, value in ep.causes.items():
            if value >= 2 * NOTABLE:
                what = {
                    stages.ROLLOUT_TOOL_WAIT: "tool wait",
                    stages.ROLLOUT_QUEUE_WAIT: "queue wait",
                    stages.ROLLOUT_REWARD: "reward",
                    GENERATE: "generation",
                }.get(cause, cause)
                out.append(f"{_pct(value)} of episode time was {what} ({cause})")
    return out


def episode_outcomes(events: Sequence[Event]) -> dict[str, int]:
    """How the run's episodes ended (done, max_turns, context_full, timeout, error, ...)."""
    counts: dict[str, int] = {}
    for e in events:
        if e.ph == "C" and e.name == stages.ROLLOUT_EPISODE_STATUS:
            status = str(e.tags.get("status", "unknown"))
            counts[status] = counts.get(status, 0) + int(e.value)
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def outcome_advice(outcomes: dict[str, int]) -> list[str]:
    """Advice on how episodes ended; it comes before any advice on speed, which means little
    while episodes end without a useful sample."""
    total = sum(outcomes.values())
    out: list[str] = []
    if not total:
        return out
    full = outcomes.get("context_full", 0)
    if full / total >= 0.5:
        out.append(f"{_pct(full / total)} of episodes ended context_full: their context (prompt, "
                   "turns, observations) filled the engine's; raise engine.max_len or "
                   "agent.max_context_tokens, or shorten the prompt or the turns")
    failed = outcomes.get("error", 0) + outcomes.get("timeout", 0)
    if failed / total >= NOTABLE:
        out.append(f"{_pct(failed / total)} of episodes failed (error or timeout; their groups "
                   "are dropped): see each episode's info['error'] in the trajectories or logs")
    return out


def advice(report: Report, dropped: int = 0) -> list[str]:
    """What to change, from fixed rules over the figures; each names the figure behind it."""
    out: list[str] = outcome_advice(report.outcomes)
    engine = report.roles.get(stages.ENGINE)
    trainer = report.roles.get(stages.TRAINER)
    ep = report.episodes
    tool_share = ep.causes.get(stages.ROLLOUT_TOOL_WAIT, 0.0) if ep else 0.0
    engine_tool_idle = engine.idle.get(stages.ROLLOUT_TOOL_WAIT, 0.0) if engine else 0.0
    starved = trainer is not None and trainer.idle.get(stages.TRAIN_DATA_WAIT, 0.0) >= STARVED
    if tool_share >= TOOL_BOUND and (engine is None or engine.busy < SATURATED):
        out.append(
            f"raise max_concurrency: {_pct(tool_share)} of episode time is tool wait and the "
            f"engine is busy only {_pct(engine.busy) if engine else 'n/a'} "
            f"({_pct(engine_tool_idle)} idle while episodes wait on tools); more episodes in "
            "flight overlap tool latency with decoding"
        )
    if starved and engine is not None and engine.busy >= SATURATED:
        out.append(
            f"generation is the bottleneck: the trainer waits "
            f"{_pct(trainer.idle[stages.TRAIN_DATA_WAIT])} for groups while the engine is busy "
            f"{_pct(engine.busy)}; give the engine more devices or slots (disaggregate), or "
            "lower group_size / max_tokens"
        )
    elif starved and tool_share < TOOL_BOUND:
        out.append(
            f"the trainer waits {_pct(trainer.idle[stages.TRAIN_DATA_WAIT])} for groups while "
            f"the engine has spare capacity: raise max_concurrency or max_staleness"
        )
    if engine is not None:
        on_trainer = sum(
            engine.idle.get(c, 0.0) for c in (stages.TRAIN_WEIGHT_SYNC, stages.TRAINER_BUSY)
        )
        if on_trainer >= 2 * NOTABLE:
            out.append(
                f"the engine waits {_pct(on_trainer)} on the trainer (weight sync or turns on "
                "a shared device): raise sync_every or disaggregate engine and trainer"
            )
    if trainer is not None and trainer.idle.get(stages.TRAIN_WEIGHT_SYNC, 0.0) >= SYNC_HEAVY:
        out.append(
            f"weight sync takes {_pct(trainer.idle[stages.TRAIN_WEIGHT_SYNC])} of the trainer: "
            "raise sync_every"
        )
    queue = report.gauges.get(stages.ENGINE_QUEUE_DEPTH)
    if queue is not None and queue.time_mean >= 1.0:
        out.append(
            f"requests queue for a slot (mean depth {queue.time_mean:.2f}, max {queue.max:g}): "
            "raise max_slots"
        )
    groups = report.gauges.get(stages.GROUP_QUEUE_DEPTH)
    if groups is not None and groups.time_mean >= 2.0 and trainer and trainer.busy >= SATURATED:
        out.append(
            f"groups pile up for the trainer (mean depth {groups.time_mean:.2f}) while it is "
            f"busy {_pct(trainer.busy)}: training is the bottleneck; give it more devices"
        )
    for role, rt in report.roles.items():
        if rt.unattributed >= UNEXPLAINED:
            out.append(
                f"{_pct(rt.unattributed)} of the {role}'s time is unexplained: wrap the rest of "
                "its loop in perf.span(...) so the report can name it"
            )
    if dropped:
        out.append(
            f"{dropped} events were dropped by a full ring: raise PerfConfig.capacity or lower "
            "flush_interval_s"
        )
    return out


def format_text(report: Report) -> str:
    lines = [
        f"nonstop report: {report.run_dir}",
        f"  window {report.window_s:.3f} s, "
        + ("complete run" if report.complete else "INCOMPLETE run (no end marker)"),
    ]
    if report.problems:
        lines.append("missing or unreadable:")
        lines += [f"  - {p}" for p in report.problems]
    lines.append("where time went:")
    if not report.roles:
        lines.append("  no device-busy intervals recorded; no role to attribute")
    for role, rt in report.roles.items():
        lines.append(
            f"  {role:8s} busy {_pct(rt.busy):>6s}   idle {_pct(1 - rt.busy):>6s}   "
            f"attributed {_pct(rt.attributed)}"
        )
        for name, value in rt.busy_in.items():
            lines.append(f"      busy in {name:40s} {_pct(value):>6s}")
        for name, value in rt.idle.items():
            lines.append(f"      idle: {rt.cause_text(name):54s} {_pct(value):>6s}")
        lines.append(f"      idle: {'unattributed':54s} {_pct(rt.unattributed):>6s}")
    ep = report.episodes
    if ep is not None:
        lines.append(f"  episodes: {ep.count}, mean {ep.mean_s:.3f} s, total {ep.total_s:.3f} s")
        for name, value in ep.causes.items():
            lines.append(f"      {name:48s} {_pct(value):>6s}")
        lines.append(f"      {'unattributed':48s} {_pct(ep.unattributed):>6s}")
    if report.outcomes:
        lines.append("episode outcomes: " + ", ".join(
            f"{status} {n}" for status, n in report.outcomes.items()))
    if report.findings:
        lines.append("who waited on whom:")
        lines += [f"  - {s}" for s in report.findings]
    if report.advice:
        lines.append("advice:")
        lines += [f"  - {s}" for s in report.advice]
    if report.stages:
        lines.append("stages:")
        lines.append(
            f"  {'stage':28s} {'role':8s} {'count':>7s} {'total s':>9s} {'mean ms':>9s} "
            f"{'p50 ms':>9s} {'p99 ms':>9s} {'util':>7s} {'conc':>6s}"
        )
        for name, st in report.stages.items():
            lines.append(
                f"  {name:28s} {st.role:8s} {st.count:7d} {st.total_s:9.3f} {st.mean_s * 1e3:9.2f}"
                f" {st.p50_s * 1e3:9.2f} {st.p99_s * 1e3:9.2f} {_pct(st.occupancy):>7s}"
                f" {st.concurrency:6.2f}"
            )
    if report.rates:
        lines.append("rates:")
        for name, value in report.rates.items():
            lines.append(f"  {name:36s} {value:12.4g} /s   (total {report.totals[name]:g})")
    if report.gauges:
        lines.append("queues and gauges (time-weighted mean, max, last):")
        for name, g in report.gauges.items():
            lines.append(f"  {name:36s} {g.time_mean:9.2f} {g.max:9g} {g.last:9g}")
    if report.staleness:
        lines.append("staleness (policy versions behind, episodes):")
        most = max(report.staleness.values())
        for value, n in report.staleness.items():
            lines.append(f"  {value:6g} {n:7d} " + "#" * max(1, round(40 * n / most)))
    if report.mfu is not None:
        lines.append(f"model FLOPs utilisation: {_pct(report.mfu)}")
    lines.append("files:")
    lines += [f"  {name:20s} {status}" for name, status in report.files.items()]
    return "\n".join(lines)


def write_json(report: Report, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report.to_json(), f, indent=1, default=str)
