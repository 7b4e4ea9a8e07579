"""Spans, counters and gauges from threads and asyncio tasks: durations, nesting, tags, bounds.

Durations are checked against the sleeps that produced them: a span can never be shorter than
its sleep (lower tolerance 0.5 ms for clock granularity) and, on a loaded shared CPU, may run
late by up to 40 ms.
"""

import asyncio
import gc
import threading
import time

import pytest

from nonstop import perf

LOW_NS = 500_000
HIGH_NS = 40_000_000


def _by_name(events, name):
    return [e for e in events if e.name == name]


def test_threads_record_every_span_with_durations_and_parents(fresh):
    rec = fresh()
    n_threads, n_iters = 8, 4

    def worker(k: int) -> None:
        for i in range(n_iters):
            with perf.span("train/step", step=i, worker=k):
                with perf.span("train/data_wait", step=i, worker=k):
                    time.sleep(0.002 * (k % 3 + 1))
                time.sleep(0.001)

    threads = [threading.Thread(target=worker, args=(k,), name=f"w{k}") for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = rec.events()
    outer, inner = _by_name(events, "train/step"), _by_name(events, "train/data_wait")
    assert len(outer) == len(inner) == n_threads * n_iters
    tids = {t.ident for t in threads}
    outer_by_id = {e.id: e for e in outer}
    for e in inner:
        sleep_ns = int(0.002 * (e.tags["worker"] % 3 + 1) * 1e9)
        assert sleep_ns - LOW_NS <= e.duration_ns <= sleep_ns + HIGH_NS
        parent = outer_by_id[e.parent]  # the step of the same worker and iteration
        assert (parent.tags["worker"], parent.tags["step"]) == (e.tags["worker"], e.tags["step"])
        assert parent.tid == e.tid
        assert parent.t0 <= e.t0 and e.t1 <= parent.t1
        assert e.role == "trainer" and e.task is None
    for e in outer:
        assert e.parent == 0  # a new thread starts with no open span
        assert e.tid in tids
        sleep_ns = int((0.002 * (e.tags["worker"] % 3 + 1) + 0.001) * 1e9)
        assert sleep_ns - LOW_NS <= e.duration_ns <= sleep_ns + 2 * HIGH_NS


def test_asyncio_tasks_nest_per_task(fresh):
    rec = fresh()
    n_tasks = 24

    async def episode(k: int) -> None:
        with perf.span("rollout/env", episode=k):
            for turn in range(3):
                with perf.span("rollout/tool_wait", episode=k, turn=turn):
                    await asyncio.sleep(0.001 * ((k + turn) % 4 + 1))
                await asyncio.sleep(0)

    async def main() -> int:
        with perf.span("rollout/batch") as batch:
            tasks = [asyncio.create_task(episode(k), name=f"ep{k}") for k in range(n_tasks)]
            await asyncio.gather(*tasks)
            return batch.id

    batch_id = asyncio.run(main())
    events = rec.events()
    envs = {e.tags["episode"]: e for e in _by_name(events, "rollout/env")}
    waits = _by_name(events, "rollout/tool_wait")
    assert len(envs) == n_tasks and len(waits) == 3 * n_tasks
    for k, env in envs.items():
        assert env.parent == batch_id  # tasks inherit the span open when they were created
        assert env.task == f"ep{k}" and env.role == "rollout"
    for w in waits:
        env = envs[w.tags["episode"]]
        assert w.parent == env.id and w.task == env.task and w.task_key == env.task_key
        sleep_ns = int(0.001 * ((w.tags["episode"] + w.tags["turn"]) % 4 + 1) * 1e9)
        assert sleep_ns - LOW_NS <= w.duration_ns <= sleep_ns + HIGH_NS
    (batch,) = _by_name(events, "rollout/batch")
    assert batch.task is not None and batch.parent == 0


def test_decorator_sync_async_and_errors(fresh):
    rec = fresh()

    @perf.span("rollout/reward", kind="exact")
    def score(x: int) -> int:
        time.sleep(0.003)
        return x * 2

    @perf.span("rollout/env")
    async def step(x: int) -> int:
        await asyncio.sleep(0.004)
        return x + 1

    @perf.span("train/checkpoint")
    def broken() -> None:
        raise KeyError("boom")

    assert score(5) == 10 and score(6) == 12
    assert asyncio.run(step(1)) == 2
    with pytest.raises(KeyError):
        broken()
    assert score.__name__ == "score"
    with pytest.raises(TypeError, match="generator"):

        @perf.span("x/y")
        def gen():
            yield 1

    events = rec.events()
    scores = _by_name(events, "rollout/reward")
    assert [e.tags for e in scores] == [{"kind": "exact"}, {"kind": "exact"}]
    assert all(3_000_000 - LOW_NS <= e.duration_ns <= 3_000_000 + HIGH_NS for e in scores)
    (s,) = _by_name(events, "rollout/env")
    assert 4_000_000 - LOW_NS <= s.duration_ns <= 4_000_000 + HIGH_NS and s.task is not None
    (b,) = _by_name(events, "train/checkpoint")
    assert b.tags == {"error": "KeyError"}


def test_async_with_and_set_tags(fresh):
    rec = fresh()

    async def main() -> None:
        async with perf.span("rollout/decode", step=1) as s:
            s.set(tokens=17)
        with perf.span("custom", role="bench"):
            pass

    asyncio.run(main())
    dec, custom = rec.events()
    assert dec.tags == {"step": 1, "tokens": 17} and dec.role == "engine"
    assert custom.role == "bench"


def test_counters_gauges_and_roles(fresh):
    rec = fresh()
    with perf.span("train/step") as step:
        perf.count(perf.TRAIN_TOKENS, 128, step=3)
        perf.count(perf.TRAIN_TOKENS, 64)
    perf.gauge(perf.ENGINE_QUEUE_DEPTH, 5)
    perf.count("misc")
    with perf.device_busy(perf.ENGINE, step=9):
        pass
    c1, c2, _, g, misc, busy = rec.events()
    assert (c1.ph, c1.value, c1.tags, c1.parent, c1.role) == (
        "C",
        128.0,
        {"step": 3},
        step.id,
        "trainer",
    )
    assert (c2.value, c2.tags) == (64.0, {})
    assert (g.ph, g.value, g.role, g.parent) == ("G", 5.0, "engine", 0)
    assert (misc.value, misc.role) == (1.0, "main")
    assert (busy.name, busy.role, busy.tags) == ("engine/device_busy", "engine", {"step": 9})
    assert perf.role_of("rollout/prefill") == "engine"
    assert perf.role_of("rollout/tool_wait") == "rollout"
    assert perf.role_of("train/anything") == "trainer"
    assert perf.role_of("bench/warmup") == "bench"


def test_disabled_records_nothing(fresh):
    rec = fresh(enabled=False)
    with perf.span("train/step") as s:
        perf.count("x")
        perf.gauge("y", 1)
    assert s.id == 0 and rec.events() == [] and rec.dropped == 0


def test_ring_is_bounded_and_counts_drops(fresh):
    rec = fresh(capacity=16)
    for i in range(100):
        with perf.span("rollout/decode", i=i):
            pass
    events = rec.events()
    assert len(events) == 16 and rec.dropped == 84
    assert [e.tags["i"] for e in events] == list(range(84, 100))  # the oldest went first
    assert len(rec.drain()) == 16 and rec.events() == []
    perf.count("c")
    assert rec.dropped == 84  # draining made room again


def test_buffered_events_drop_out_of_the_garbage_collectors_sight(fresh):
    """Events with atomic tags (all the hot paths record) stop being tracked after one
    collection, so a full ring costs nothing to every later full collection; their tags read
    back as dicts."""
    rec = fresh()
    with perf.span("rollout/decode", active=3, stage="x"):
        pass
    with perf.span("rollout/decode"):
        pass
    perf.count("engine/tokens", 5)
    perf.gauge("engine/queue_depth", 2, slot=1)
    perf.device_busy_interval(perf.ENGINE, 10, 20, calls=1)
    gc.collect()
    raws = list(rec._ring)
    assert len(raws) == 5 and not any(gc.is_tracked(r) for r in raws)
    assert [e.tags for e in rec.events()] == [
        {"active": 3, "stage": "x"}, {}, {}, {"slot": 1}, {"calls": 1}]


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match=r"^PerfConfig\.capacity=3 is invalid; expected an int "
                                         r">= 16$"):
        perf.PerfConfig(capacity=3)
    with pytest.raises(ValueError, match=r"^PerfConfig\.flush_interval_s=0 is invalid"):
        perf.PerfConfig(flush_interval_s=0)
    with pytest.raises(ValueError, match=r"^PerfConfig\.peak_flops_per_s=-1\.0 is invalid"):
        perf.PerfConfig(peak_flops_per_s=-1.0)
    with pytest.raises(ValueError, match=r"^PerfConfig\.prometheus_port=65536 is invalid"):
        perf.PerfConfig(prometheus_port=65536)
    with pytest.raises(ValueError, match=r"^Stage\.kind='busy' is invalid; expected one of "
                                         r"'device', 'host', 'wait' \(stage 'a/b'\)$"):
        perf.Stage(name="a/b", role="a", kind="busy")
    with pytest.raises(ValueError, match=r"^Stage\.role='' is invalid; expected a non-empty "
                                         r"string$"):
        perf.Stage(name="a/b", role="", kind="host")
