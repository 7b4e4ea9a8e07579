"""Export `events.jsonl` to a Perfetto/Chrome trace-event JSON, and load one back to check it.

Layout (open `trace.json` in https://ui.perfetto.dev or chrome://tracing):
- one process per role (`engine`, `rollout`, `trainer`, …), named by `process_name` metadata;
- inside it one thread track per OS thread, and per asyncio task on that thread (concurrent
  episodes on one event loop would otherwise overlap on one track, which the format forbids);
- spans are complete ("X") events with their tags, id and parent in `args`;
- counters become "C" tracks of their running total, gauges "C" tracks of their value.

Timestamps are microseconds since the run's clock anchor; `otherData` carries the wall-clock
anchor, the dropped-event count and anything missing from a crashed run. The exporter streams:
memory grows with the number of tracks, not events.
"""

import dataclasses
import json
import os
from typing import Any

from nonstop.perf.events import Event, iter_lines


class TraceError(ValueError):
    """A trace file that does not load or breaks the trace-event format."""


def _us(ns: int) -> float:
    return round(ns / 1000, 3)


def write_trace(events_path: str, out_path: str) -> dict[str, Any]:
    """Write the Perfetto trace of `events_path` (a run's events.jsonl, finished or crashed) to
    `out_path`; returns its `otherData` (anchor, dropped count, problems)."""
    if os.path.isdir(events_path):
        events_path = os.path.join(events_path, "events.jsonl")
    pids: dict[str, int] = {}
    tracks: dict[tuple[str, int, int, str | None], int] = {}
    thread_names: dict[int, str] = {}
    counter_totals: dict[tuple[str, str], float] = {}
    meta: dict[str, Any] = {}
    dropped, complete, bad, n_events = 0, False, 0, 0
    tmp = out_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        out.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        first = True

        def emit(obj: dict[str, Any]) -> None:
            nonlocal first
            out.write(("" if first else ",\n") + json.dumps(obj, default=str))
            first = False

        for _, obj, _ in iter_lines(events_path) if os.path.exists(events_path) else ():
            ph = obj.get("ph") if obj is not None else None
            try:
                if ph == "M":
                    meta = obj
                elif ph == "T":
                    thread_names[int(obj["tid"])] = str(obj["name"])
                elif ph in ("D", "E"):
                    dropped = max(dropped, int(obj["dropped"]))
                    complete = complete or ph == "E"
                elif ph in ("X", "C", "G"):
                    event = Event.from_json(obj)
                    pid = pids.setdefault(event.role, len(pids) + 1)
                    n_events += 1
                    if ph == "X":
                        key = (event.role, event.tid, event.task_key, event.task)
                        tid = tracks.setdefault(key, len(tracks) + 1)
                        args = {**event.tags, "id": event.id, "parent": event.parent}
                        emit(
                            {"name": event.name, "cat": event.role, "ph": "X",
                             "ts": _us(event.t0), "dur": round(_us(event.t1) - _us(event.t0), 3),
                             "pid": pid, "tid": tid, "args": args}
                        )  # fmt: skip
                    else:
                        value = event.value
                        if ph == "C":
                            total = counter_totals.get((event.role, event.name), 0.0) + value
                            counter_totals[(event.role, event.name)] = value = total
                        emit(
                            {"name": event.name, "ph": "C", "ts": _us(event.t0), "pid": pid,
                             "args": {"value": value}}
                        )  # fmt: skip
                else:
                    bad += 1
            except (KeyError, TypeError, ValueError):
                bad += 1
        for role, pid in pids.items():
            emit({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": role}})
            emit({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        for (role, os_tid, task_key, task), tid in tracks.items():
            thread = thread_names.get(os_tid, f"thread-{os_tid}")
            name = thread if task_key == 0 else f"{task} @ {thread}"
            emit({"name": "thread_name", "ph": "M", "pid": pids[role], "tid": tid,
                  "args": {"name": name}})  # fmt: skip
        problems = []
        if not meta:
            problems.append("no header line: wall-clock anchor unknown")
        if not complete:
            problems.append("no end marker: the run did not finish; later events are missing")
        if bad:
            problems.append(f"{bad} unreadable line(s) skipped (a crash can leave half a line)")
        if dropped:
            problems.append(f"{dropped} event(s) dropped by a full ring buffer")
        other = {
            "anchor_wall_ns": meta.get("anchor_wall_ns"),
            "host": meta.get("host"),
            "pid": meta.get("pid"),
            "events": n_events,
            "dropped": dropped,
            "complete": complete,
            "problems": problems,
        }
        out.write('\n], "otherData": ' + json.dumps(other) + "}\n")
    os.replace(tmp, out_path)  # never leave a half-written trace.json behind
    return other


@dataclasses.dataclass
class Trace:
    """A loaded trace: spans and counter samples per role, with track names."""

    spans: dict[str, list[dict[str, Any]]]  # role → its "X" events
    counters: dict[str, list[dict[str, Any]]]  # role → its "C" events
    threads: dict[str, dict[int, str]]  # role → track id → track name
    other: dict[str, Any]

    @property
    def roles(self) -> list[str]:
        return sorted(set(self.spans) | set(self.counters))


_EPS_US = 0.002  # timestamps are rounded to the nanosecond, 0.001 µs


def load_trace(path: str) -> Trace:
    """Parse a trace written by `write_trace` and check it is well formed: every event has the
    fields its phase needs, durations are not negative, every process is named, and spans on
    each track nest (a child ends before its parent)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise TraceError(f"{path}: not a loadable trace: {err}") from err
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(f"{path}: no 'traceEvents' list")
    names: dict[int, str] = {}
    threads: dict[int, dict[int, str]] = {}
    spans: list[dict[str, Any]] = []
    counters: list[dict[str, Any]] = []
    required = {"X": ("name", "ts", "dur", "pid", "tid"), "C": ("name", "ts", "pid", "args")}
    for i, ev in enumerate(doc["traceEvents"]):
        ph = ev.get("ph")
        if ph == "M":
            if ev.get("name") == "process_name":
                names[ev["pid"]] = ev["args"]["name"]
            elif ev.get("name") == "thread_name":
                threads.setdefault(ev["pid"], {})[ev["tid"]] = ev["args"]["name"]
            continue
        if ph not in required:
            raise TraceError(f"{path}: event {i} has unknown phase {ph!r}")
        missing = [k for k in required[ph] if k not in ev]
        if missing:
            raise TraceError(f"{path}: event {i} ({ph}) lacks {missing}")
        if ph == "X" and ev["dur"] < 0:
            raise TraceError(f"{path}: event {i} {ev['name']!r} has negative duration")
        (spans if ph == "X" else counters).append(ev)
    for ev in spans + counters:
        if ev["pid"] not in names:
            raise TraceError(f"{path}: pid {ev['pid']} of {ev['name']!r} has no process_name")
    by_track: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for ev in spans:
        by_track.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    for (pid, tid), evs in by_track.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends: list[float] = []
        for ev in evs:
            while open_ends and open_ends[-1] <= ev["ts"] + _EPS_US:
                open_ends.pop()
            end = ev["ts"] + ev["dur"]
            if open_ends and end > open_ends[-1] + _EPS_US:
                raise TraceError(
                    f"{path}: {ev['name']!r} at {ev['ts']} µs overlaps its enclosing span on "
                    f"track {names[pid]}/{threads.get(pid, {}).get(tid, tid)} without nesting"
                )
            open_ends.append(end)
    out_spans: dict[str, list[dict[str, Any]]] = {}
    out_counters: dict[str, list[dict[str, Any]]] = {}
    for ev in spans:
        out_spans.setdefault(names[ev["pid"]], []).append(ev)
    for ev in counters:
        out_counters.setdefault(names[ev["pid"]], []).append(ev)
    return Trace(
        spans=out_spans,
        counters=out_counters,
        threads={names[p]: t for p, t in threads.items() if p in names},
        other=doc.get("otherData", {}),
    )
