"""A run directory: streaming events.jsonl, crash tolerance, the Perfetto trace, scalars."""

import asyncio
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from nonstop import perf


def _engine(steps: int) -> None:
    for i in range(steps):
        with perf.span(perf.ROLLOUT_DECODE, step=i):
            with perf.device_busy(perf.ENGINE, step=i):
                time.sleep(0.002)
            perf.count(perf.ENGINE_TOKENS, 8)
            perf.gauge(perf.ENGINE_QUEUE_DEPTH, i % 3)


def _trainer(steps: int) -> None:
    for i in range(steps):
        with perf.span(perf.TRAIN_DATA_WAIT, step=i):
            time.sleep(0.001)
        with perf.span(perf.TRAIN_STEP, step=i):
            with perf.device_busy(perf.TRAINER, step=i):
                time.sleep(0.002)


async def _rollouts(n: int) -> None:
    async def episode(k: int) -> None:
        with perf.span(perf.ROLLOUT_ENV, episode=k):
            with perf.span(perf.ROLLOUT_TOOL_WAIT, episode=k):
                await asyncio.sleep(0.002)
            with perf.span(perf.ROLLOUT_REWARD, episode=k):
                pass
        perf.count(perf.ROLLOUT_EPISODES)

    await asyncio.gather(*(asyncio.create_task(episode(k), name=f"ep{k}") for k in range(n)))


def test_run_writes_events_trace_and_scalars(fresh, tmp_path):
    fresh()
    cfg = perf.PerfConfig(flush_interval_s=0.02, scalars_every_s=0.05, peak_flops_per_s=1e6)
    with perf.run(tmp_path, cfg):
        assert perf.active_run_dir() == str(tmp_path)
        engine = threading.Thread(target=_engine, args=(10,), name="engine-scheduler")
        trainer = threading.Thread(target=_trainer, args=(6,), name="trainer-loop")
        engine.start(), trainer.start()
        asyncio.run(_rollouts(5))
        perf.count(perf.TRAIN_FLOPS, 2e5)
        engine.join(), trainer.join()
    assert perf.active_run_dir() is None

    log = perf.read_events(str(tmp_path))
    assert log.complete and log.problems == [] and log.dropped == 0
    names = [e.name for e in log.events]
    assert names.count(perf.ROLLOUT_DECODE) == names.count(perf.ENGINE_BUSY) == 10
    assert names.count(perf.TRAIN_STEP) == names.count(perf.TRAINER_BUSY) == 6
    assert names.count(perf.ROLLOUT_TOOL_WAIT) == 5
    assert "engine-scheduler" in log.thread_names.values()
    assert log.meta["anchor_wall_ns"] > 0

    trace = perf.load_trace(str(tmp_path / "trace.json"))
    assert trace.roles == ["engine", "rollout", "trainer"]
    span_names = {role: {e["name"] for e in evs} for role, evs in trace.spans.items()}
    assert span_names == {
        "engine": {perf.ROLLOUT_DECODE, perf.ENGINE_BUSY},
        "trainer": {perf.TRAIN_DATA_WAIT, perf.TRAIN_STEP, perf.TRAINER_BUSY},
        "rollout": {perf.ROLLOUT_ENV, perf.ROLLOUT_TOOL_WAIT, perf.ROLLOUT_REWARD},
    }
    assert len(trace.spans["engine"]) == 20 and len(trace.spans["trainer"]) == 18
    # One track per episode task, so concurrent episodes never overlap on a track.
    rollout_tracks = {e["tid"] for e in trace.spans["rollout"]}
    assert len(rollout_tracks) == 5
    assert sorted(trace.threads["rollout"].values())[0].startswith("ep0 @ ")
    assert "engine-scheduler" in trace.threads["engine"].values()
    tokens = [e for e in trace.counters["engine"] if e["name"] == perf.ENGINE_TOKENS]
    assert [e["args"]["value"] for e in tokens] == [8.0 * (i + 1) for i in range(10)]
    busy = [e for e in trace.spans["engine"] if e["name"] == perf.ENGINE_BUSY]
    assert all(e["dur"] >= 2000 - 500 for e in busy)  # µs; each wraps a 2 ms sleep
    assert trace.other["complete"] and trace.other["dropped"] == 0

    rows = perf.read_metrics(str(tmp_path))
    assert rows and [r["step"] for r in rows] == list(range(len(rows)))
    total_tokens = sum(r.get("rate/engine/tokens_per_s", 0) * r["perf/window_s"] for r in rows)
    assert total_tokens == pytest.approx(80.0, rel=1e-6)
    assert any("busy/engine" in r for r in rows)
    assert any(r.get("mfu") for r in rows)
    tb = _read_tensorboard(tmp_path / "tensorboard")
    assert "busy/engine" in tb and len(tb["busy/engine"]) >= 1
    assert sum(tb["perf/window_s"]) == pytest.approx(sum(r["perf/window_s"] for r in rows))


def _read_tensorboard(logdir) -> dict[str, list[float]]:
    """Scalars of tfevents files: TFRecord framing (u64 length, u32 crc, data, u32 crc)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[float]] = {}
    for name in os.listdir(logdir):
        data = (logdir / name).read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append(v.simple_value)
    return out


def test_a_thread_that_ends_before_the_flush_keeps_its_name(fresh, tmp_path):
    """Names are taken when a thread records, not when the flusher drains: the CI failure was
    a worker thread gone by the first flush, written as `thread-<ident>`."""
    fresh()
    cfg = perf.PerfConfig(flush_interval_s=3600, write_trace=False, tensorboard=False)
    with perf.run(tmp_path, cfg):
        both_alive = threading.Barrier(2)  # alive together, so their idents differ

        def work() -> None:
            both_alive.wait()
            _engine(1)

        workers = [threading.Thread(target=work, name=n) for n in ("short-a", "short-b")]
        [w.start() for w in workers], [w.join() for w in workers]  # gone before any flush
        perf.count(perf.ROLLOUT_EPISODES)
    names = perf.read_events(str(tmp_path)).thread_names
    assert sorted(names.values()) == sorted(["short-a", "short-b", threading.current_thread().name])


def test_full_ring_drops_are_exported(fresh, tmp_path):
    fresh()
    cfg = perf.PerfConfig(capacity=16, flush_interval_s=30.0, tensorboard=False)
    with perf.run(tmp_path, cfg):
        for i in range(100):
            perf.count("c", i)
    log = perf.read_events(str(tmp_path))
    assert log.dropped == 84 and len(log.events) == 16
    assert [e.value for e in log.events] == list(range(84, 100))
    assert any("84 event(s) dropped" in p for p in log.problems)
    assert perf.load_trace(str(tmp_path / "trace.json")).other["dropped"] == 84


CRASHING_RUN = textwrap.dedent(
    """
    import os, sys, time
    from nonstop import perf
    perf.start_run(sys.argv[1], perf.PerfConfig(flush_interval_s=0.01, tensorboard=False))
    for i in range(50):
        with perf.span("train/step", step=i):
            pass
    with perf.span("train/checkpoint"):   # open when the process dies: never recorded
        time.sleep(0.3)                    # long enough for several flushes
        os._exit(1)
    """
)


def test_crashed_run_keeps_whole_lines_and_says_what_is_missing(tmp_path):
    subprocess.run([sys.executable, "-c", CRASHING_RUN, str(tmp_path)], check=False, timeout=60)
    path = tmp_path / "events.jsonl"
    assert not (tmp_path / "trace.json").exists()
    with open(path, "a") as f:  # a writer killed mid-line
        f.write('{"ph": "X", "name": "train/st')
    log = perf.read_events(str(tmp_path))
    assert [e.tags["step"] for e in log.events] == list(range(50))
    assert not log.complete
    assert any("half-written" in p for p in log.problems)
    assert any("no end marker" in p for p in log.problems)
    other = perf.write_trace(str(tmp_path), str(tmp_path / "trace.json"))
    assert not other["complete"] and other["events"] == 50
    trace = perf.load_trace(str(tmp_path / "trace.json"))
    assert len(trace.spans["trainer"]) == 50


def test_missing_events_file_is_reported(tmp_path):
    log = perf.read_events(str(tmp_path))
    assert log.events == [] and "missing" in log.problems[0]


def test_load_trace_rejects_broken_nesting(tmp_path):
    path = tmp_path / "bad.json"
    meta = {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "engine"}}
    a = {"name": "a", "ph": "X", "ts": 0, "dur": 10, "pid": 1, "tid": 1}
    b = {"name": "b", "ph": "X", "ts": 5, "dur": 10, "pid": 1, "tid": 1}
    path.write_text(json.dumps({"traceEvents": [meta, a, b]}))
    with pytest.raises(perf.TraceError, match="overlaps"):
        perf.load_trace(str(path))
    b["tid"] = 2  # the same spans on separate tracks are fine
    path.write_text(json.dumps({"traceEvents": [meta, a, b]}))
    assert len(perf.load_trace(str(path)).spans["engine"]) == 2
    path.write_text('{"traceEvents": [')
    with pytest.raises(perf.TraceError, match="not a loadable"):
        perf.load_trace(str(path))


def test_second_run_sets_aside_earlier_events(fresh, tmp_path):
    fresh()
    cfg = perf.PerfConfig(tensorboard=False, write_trace=False)
    for step in range(2):
        with perf.run(tmp_path, cfg):
            with perf.span("train/step", step=step):
                pass
    assert [e.tags["step"] for e in perf.read_events(str(tmp_path / "events.1.jsonl")).events] == [
        0
    ]
    assert [e.tags["step"] for e in perf.read_events(str(tmp_path)).events] == [1]
    with perf.run(tmp_path, cfg), pytest.raises(RuntimeError, match="already active"):
        perf.start_run(tmp_path / "other", cfg)


def test_prometheus_serves_running_totals(fresh, tmp_path):
    fresh()
    cfg = perf.PerfConfig(flush_interval_s=0.01, tensorboard=False, prometheus_port=0)
    with perf.run(tmp_path, cfg):
        port = perf.recorder.STATE.prometheus.port
        perf.count(perf.ENGINE_TOKENS, 64)
        with perf.span(perf.TRAIN_STEP):
            pass
        expected = 'nonstop_perf_counter_total{name="engine/tokens"} 64.0'
        deadline = time.monotonic() + 10
        while True:  # wait for the flusher to have drained the ring, with a deadline
            body = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            if expected in body or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    assert expected in body
    assert 'nonstop_perf_spans_total{name="train/step"} 1.0' in body
    assert "nonstop_perf_dropped_events_total 0.0" in body


def test_pipelined_busy_intervals_get_their_own_track_and_count_once(fresh, tmp_path):
    # A pipelined loop: step N+1 is launched (its busy interval starts) inside the span that
    # reads step N back, so the intervals overlap the spans of the recording thread.
    fresh()
    ms = 1_000_000
    with perf.run(tmp_path, perf.PerfConfig(flush_interval_s=0.02)):
        t0 = time.perf_counter_ns()
        for i in range(3):
            with perf.span(perf.ROLLOUT_DECODE, step=i):
                time.sleep(0.002)
            perf.device_busy_interval(perf.ENGINE, t0 + i * 10 * ms, t0 + (i + 1) * 10 * ms)
        perf.device_busy_interval(perf.ENGINE, t0 + 40 * ms, t0 + 40 * ms)  # empty: dropped
    log = perf.read_events(str(tmp_path))
    busy = [e for e in log.events if e.name == perf.ENGINE_BUSY]
    assert [(e.t1 - e.t0) // ms for e in busy] == [10, 10, 10]
    window = (busy[0].t0, busy[0].t0 + 40 * ms)  # event times are relative to the run
    assert perf.busy_fraction(log.events, perf.ENGINE, window) == pytest.approx(0.75)
    trace = perf.load_trace(str(tmp_path / "trace.json"))  # validates nesting per track
    assert "engine device @ MainThread" in trace.threads["engine"].values()


def test_every_counted_token_lands_in_exactly_one_scalars_window(fresh, tmp_path):
    """A count recorded between a drain and the figures written after it belongs to the next
    window (the window ends where the drain began), and one whose clock was read before a
    window closed but that reached the ring after it counts in the next window too: summed
    over the windows, tokens/s times window length gives back every token."""
    from nonstop.perf import recorder, spans

    fresh()
    with perf.run(tmp_path, perf.PerfConfig(flush_interval_s=3600, scalars_every_s=3600)):
        flusher = recorder.STATE.run
        perf.count(perf.ENGINE_TOKENS, 8)
        flusher.flush()
        perf.count(perf.ENGINE_TOKENS, 16)  # after the drain, before the figures
        flusher.write_scalars()
        late = time.perf_counter_ns()  # a clock read before the next window closes ...
        flusher.flush()
        flusher.write_scalars()
        spans.STATE.recorder.append(  # ... whose event reaches the ring only now
            ("C", perf.ENGINE_TOKENS, None, late, late, 32.0, threading.get_ident(), 0, None,
             0, None), {})
    rows = perf.read_metrics(str(tmp_path))
    assert len(rows) == 3
    per_window = [r.get("rate/engine/tokens_per_s", 0) * r["perf/window_s"] for r in rows]
    assert per_window == pytest.approx([8.0, 16.0, 32.0], rel=1e-6)
