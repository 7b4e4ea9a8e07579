"""The event record and its JSONL form: what `events.jsonl` holds and how it is read back.

The hot path stores events as plain tuples (`RawEvent`); the background flusher turns them into
JSON lines and readers turn lines into `Event`s. One file per run, one JSON object per line:

    {"ph": "M", "format": 1, "anchor_perf_ns": …, "anchor_wall_ns": …, "pid": …, "host": …}
    {"ph": "T", "tid": 140…, "name": "engine-scheduler"}                 thread name, once per tid
    {"ph": "X", "name": "rollout/decode", "role": "engine", "t0": …, "t1": …, "tid": …,
     "task": "Task-7", "tk": 1, "id": 12, "parent": 11, "tags": {"step": 3}}        span
    {"ph": "C", "name": "engine/tokens", "role": "engine", "t": …, "v": 64, …}     counter delta
    {"ph": "G", "name": "engine/queue_depth", "role": "engine", "t": …, "v": 5, …}  gauge sample
    {"ph": "D", "t": …, "dropped": 17}                        events lost to the full ring so far
    {"ph": "E", "t": …, "dropped": 17, "events": 12345}                 clean end of the run

Times are integer nanoseconds since the run's `perf_counter_ns` anchor; wall time is
`anchor_wall_ns + t`. A crashed run lacks the final "E" line and may end in half a line; the
reader keeps every whole line and lists what is missing in `EventLog.problems`.
"""

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

FORMAT_VERSION = 1

# (ph, name, role | None, t0_ns, t1_ns, value, tid, task_key, task_name, id, parent, *tag_keys,
# *tag_values): flat, so an event whose tags are atomic (numbers, strings) holds no container
# and the garbage collector stops tracking it at its first collection. (A tags dict, even an
# empty one, kept every buffered event tracked, and each full collection traversed the ring.)
RawEvent = tuple[Any, ...]


@dataclasses.dataclass(slots=True)
class Event:
    """One recorded span ("X"), counter delta ("C") or gauge sample ("G")."""

    ph: str
    name: str
    role: str
    t0: int  # ns since the anchor; for counters and gauges t0 == t1
    t1: int
    value: float = 0.0
    tid: int = 0
    task: str | None = None
    task_key: int = 0
    id: int = 0
    parent: int = 0
    tags: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        return self.t1 - self.t0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ph": self.ph, "name": self.name, "role": self.role}
        if self.ph == "X":
            out.update(t0=self.t0, t1=self.t1, id=self.id, parent=self.parent)
        else:
            out.update(t=self.t0, v=self.value)
        out["tid"] = self.tid
        if self.task is not None:
            out.update(task=self.task, tk=self.task_key)
        if self.tags:
            out["tags"] = self.tags
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Event":
        ph = obj["ph"]
        if ph == "X":
            t0, t1, value = int(obj["t0"]), int(obj["t1"]), 0.0
        elif ph in ("C", "G"):
            t0 = t1 = int(obj["t"])
            value = float(obj["v"])
        else:
            raise ValueError(f"not an event line: ph={ph!r}")
        return cls(
            ph=ph,
            name=str(obj["name"]),
            role=str(obj["role"]),
            t0=t0,
            t1=t1,
            value=value,
            tid=int(obj.get("tid", 0)),
            task=obj.get("task"),
            task_key=int(obj.get("tk", 0)),
            id=int(obj.get("id", 0)),
            parent=int(obj.get("parent", 0)),
            tags=dict(obj.get("tags") or {}),
        )


def event_from_raw(raw: RawEvent, role: str, anchor_ns: int) -> Event:
    """The `Event` of a hot-path tuple; its absolute `perf_counter_ns` times become anchor-relative."""
    ph, name, _, t0, t1, value, tid, task_key, task, span_id, parent = raw[:11]
    n = (len(raw) - 11) // 2
    tags = dict(zip(raw[11:11 + n], raw[11 + n:], strict=True)) if n else {}
    return Event(
        ph,
        name,
        role,
        t0 - anchor_ns,
        t1 - anchor_ns,
        value,
        tid,
        task,
        task_key,
        span_id,
        parent,
        tags,
    )


_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)  # one, reused: the C fast path


def encode_line(obj: dict[str, Any]) -> str:
    """One JSON line; tag values that JSON cannot hold are written as their `str`."""
    return _ENCODER.encode(obj) + "\n"


@dataclasses.dataclass
class EventLog:
    """Everything readable from one `events.jsonl`, and what could not be read."""

    path: str
    meta: dict[str, Any]
    events: list[Event]
    thread_names: dict[int, str]
    dropped: int  # events the recorder dropped because its ring was full
    complete: bool  # the run wrote its end marker
    problems: list[str]

    @property
    def start_ns(self) -> int:
        return min((e.t0 for e in self.events), default=0)

    @property
    def end_ns(self) -> int:
        return max((e.t1 for e in self.events), default=0)


def iter_lines(path: str) -> Iterator[tuple[int, dict[str, Any] | None, str]]:
    """(line number, parsed object or None, raw text) for each line of `path`."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            text = line.rstrip("\n")
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                obj = None
            if obj is not None and not isinstance(obj, dict):
                obj = None
            yield lineno, obj, text


def read_events(path: str) -> EventLog:
    """Read an `events.jsonl` (or a run directory holding one), tolerating a crashed writer."""
    if os.path.isdir(path):
        path = os.path.join(path, "events.jsonl")
    problems: list[str] = []
    if not os.path.exists(path):
        return EventLog(path, {}, [], {}, 0, False, [f"{path}: missing, no events recorded"])
    meta: dict[str, Any] = {}
    events: list[Event] = []
    threads: dict[int, str] = {}
    dropped = 0
    complete = False
    bad: list[int] = []
    last_lineno = 0
    ends_with_newline = True
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            ends_with_newline = f.read(1) == b"\n"
    for lineno, obj, _ in iter_lines(path):
        last_lineno = lineno
        if obj is None:
            bad.append(lineno)
            continue
        ph = obj.get("ph")
        try:
            if ph == "M":
                meta = obj
            elif ph == "T":
                threads[int(obj["tid"])] = str(obj["name"])
            elif ph in ("X", "C", "G"):
                events.append(Event.from_json(obj))
            elif ph == "D":
                dropped = max(dropped, int(obj["dropped"]))
            elif ph == "E":
                dropped = max(dropped, int(obj["dropped"]))
                complete = True
            else:
                bad.append(lineno)
        except (KeyError, TypeError, ValueError):
            bad.append(lineno)
    if bad and bad[-1] == last_lineno and not ends_with_newline:
        problems.append(
            f"{path}: last line {last_lineno} is half-written (crashed writer); skipped"
        )
        bad.pop()
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (" …" if len(bad) > 10 else "")
        problems.append(f"{path}: {len(bad)} unreadable line(s) skipped: {shown}")
    if not meta:
        problems.append(f"{path}: no header line; clock anchor unknown, wall times unavailable")
    if not complete:
        problems.append(
            f"{path}: no end marker — the run did not finish cleanly; events after the last "
            "flush are missing and spans still open at the crash were never recorded"
        )
    if dropped:
        problems.append(f"{path}: {dropped} event(s) dropped by a full ring buffer")
    return EventLog(path, meta, events, threads, dropped, complete, problems)
