"""Recording: spans (context manager, decorator, sync and async), counters, gauges, device busy.

    from nonstop import perf
    with perf.span(perf.ROLLOUT_DECODE, step=3) as s:   # or perf.span("rollout/decode", …)
        with perf.device_busy("engine"):
            out = decode_step(...); out.block_until_ready()
        s.set(tokens=n)
    perf.count(perf.ENGINE_TOKENS, n)
    perf.gauge(perf.ENGINE_QUEUE_DEPTH, len(waiting))

    @perf.span("rollout/reward")
    async def score(...): ...

A span records its name, role, `perf_counter_ns` start and end, thread id, asyncio task (if
any), tags and its parent span. The parent comes from a `ContextVar`, so nesting is right for
concurrent asyncio tasks (each task sees the span that was open when it was created) and for
threads (a new thread starts with no parent). With `annotate_jax` a span also enters
`jax.profiler.TraceAnnotation(name)` so XProf captures carry the same names.

A span object is for one `with` at a time; `perf.span(...)` is cheap, make a new one each time.
Used as a decorator it makes a fresh span per call.
"""

import asyncio
import functools
import inspect
import itertools
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any, TypeVar

from nonstop.perf import stages
from nonstop.perf.recorder import STATE, Recorder

F = TypeVar("F", bound=Callable[..., Any])

_PARENT: ContextVar[int] = ContextVar("nonstop_perf_parent", default=0)
_ids = itertools.count(1)  # next() on itertools.count is atomic under the GIL
_perf_ns = time.perf_counter_ns
_thread_id = threading.get_ident
_running_loop = asyncio._get_running_loop  # returns None outside a loop, without raising
_current_task = asyncio.current_task


def _task() -> tuple[int, str | None]:
    loop = _running_loop()
    if loop is None:
        return 0, None
    task = _current_task(loop)
    if task is None:
        return 0, None
    return id(task), task.get_name()


class Span:
    """A timed, tagged stage; use with `with`/`async with`, or as a decorator."""

    __slots__ = ("name", "role", "tags", "_rec", "_token", "_id", "_t0", "_ann")

    def __init__(self, name: str, /, *, role: str | None = None, **tags: Any) -> None:
        self.name = name
        self.role = role  # None: derived from the name when flushed (stages.role_of)
        self.tags = tags
        self._rec: Recorder | None = None
        self._ann: Any = None
        self._id = 0

    def set(self, **tags: Any) -> None:
        """Add tags known only inside the span (tokens produced, batch size, …)."""
        self.tags.update(tags)

    @property
    def id(self) -> int:
        """This span's id once entered (parents of nested spans refer to it); 0 if disabled."""
        return self._id

    def __enter__(self) -> "Span":
        rec = STATE.recorder
        if not rec.enabled:
            self._rec = None
            return self
        self._rec = rec
        self._id = span_id = next(_ids)
        self._token = _PARENT.set(span_id)
        if rec.annotation is not None:
            self._ann = rec.annotation(self.name)
            self._ann.__enter__()
        capture = STATE.capture
        if capture is not None:
            capture.on_enter(self.name, self.tags)
        self._t0 = _perf_ns()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: Any, tb: Any) -> None:
        t1 = _perf_ns()
        rec = self._rec
        if rec is None:
            return
        self._rec = None
        if self._ann is not None:
            self._ann.__exit__(exc_type, exc, tb)
            self._ann = None
        token = self._token
        parent = token.old_value
        if parent is Token.MISSING:
            parent = 0
        try:
            _PARENT.reset(token)
        except ValueError:  # closed in another context than it was opened in; nothing to undo
            pass
        tags = self.tags
        if exc_type is not None:
            tags = {**tags, "error": exc_type.__name__}
        task_key, task_name = 0, None  # inlined _task(): this is the hot path
        loop = _running_loop()
        if loop is not None:
            task = _current_task(loop)
            if task is not None:
                task_key, task_name = id(task), task.get_name()
        raw = ("X", self.name, self.role, self._t0, t1, 0.0, _thread_id(), task_key, task_name,
               self._id, parent)  # fmt: skip
        rec.append(raw, tags)
        capture = STATE.capture
        if capture is not None:
            capture.on_exit(self.name, self.tags)

    async def __aenter__(self) -> "Span":
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: Any, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)

    def __call__(self, fn: F) -> F:
        name, role, tags = self.name, self.role, self.tags
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with Span(name, role=role, **tags):
                    return await fn(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"perf.span({name!r}) cannot decorate generator {fn.__qualname__}: wrap the "
                "code that consumes it in a `with perf.span(...)` instead"
            )

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with Span(name, role=role, **tags):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


span = Span
"""`perf.span(name, role=None, **tags)`: a span named `name` (e.g. `stages.ROLLOUT_DECODE`) on
`role`'s track (default: derived from the name), tagged with `tags` (step, policy_version,
episode, group, …). An alias of the class, so making one costs a single call."""


_busy_names: dict[str, str] = {}


def device_busy(role: str, /, **tags: Any) -> Span:
    """The interval `role`'s device is busy: wrap exactly the jitted call and its
    `block_until_ready` at the engine's or trainer's step boundary."""
    name = _busy_names.get(role)
    if name is None:
        name = _busy_names.setdefault(role, stages.device_busy_name(role))
    return Span(name, role=role, **tags)


_DEVICE_TRACK_KEY = 1  # a task key no asyncio task has (those are object ids)
_busy_ns: dict[str, int] = {}  # role -> busy nanoseconds recorded by device_busy_interval


def busy_seconds(role: str, /) -> float:
    """Seconds of `role`'s device busy intervals recorded so far in this process (a running
    total: difference two readings for an interval's busy time)."""
    return _busy_ns.get(role, 0) / 1e9


def device_busy_interval(role: str, start_ns: int, end_ns: int, /, **tags: Any) -> None:
    """Record that `role`'s device was busy from `start_ns` to `end_ns` (`time.perf_counter_ns`).

    For pipelined loops, where a step is launched before the previous one's results are read:
    the device works on the next step while the host handles the last, so its busy intervals
    are known only afterwards and do not nest like spans. They go on a track of their own
    (beside the recording thread's), so traces stay well nested."""
    rec = STATE.recorder
    if not rec.enabled or end_ns <= start_ns:
        return
    _busy_ns[role] = _busy_ns.get(role, 0) + end_ns - start_ns
    name = _busy_names.get(role)
    if name is None:
        name = _busy_names.setdefault(role, stages.device_busy_name(role))
    raw = ("X", name, role, start_ns, end_ns, 0.0, _thread_id(), _DEVICE_TRACK_KEY,
           f"{role} device", next(_ids), _PARENT.get())  # fmt: skip
    rec.append(raw, tags)


def count(name: str, value: float = 1, /, *, role: str | None = None, **tags: Any) -> None:
    """Add `value` to counter `name` (tokens generated, episodes finished, FLOPs done)."""
    rec = STATE.recorder
    if not rec.enabled:
        return
    t = _perf_ns()
    task_key, task_name = _task()
    raw = ("C", name, role, t, t, float(value), _thread_id(), task_key, task_name, 0,
           _PARENT.get())  # fmt: skip
    rec.append(raw, tags)


def gauge(name: str, value: float, /, *, role: str | None = None, **tags: Any) -> None:
    """Record one sample of gauge `name` (a queue depth, a staleness, active slots)."""
    rec = STATE.recorder
    if not rec.enabled:
        return
    t = _perf_ns()
    task_key, task_name = _task()
    raw = ("G", name, role, t, t, float(value), _thread_id(), task_key, task_name, 0,
           _PARENT.get())  # fmt: skip
    rec.append(raw, tags)


def current_span_id() -> int:
    """The id of the innermost open span in this thread/task, 0 if none."""
    return _PARENT.get()
