"""The run report: exact attribution on hand-built timelines; on a live synthetic pipeline of
known sleeps every figure within 2% of the schedule and >= 95% of each role's time named; the
timeline PNG read back pixel by pixel with Pillow; crashed and empty run directories."""

import asyncio
import json
import os
import queue
import shutil
import threading
import time

import numpy as np
import pytest
from PIL import Image

from nonstop import perf
from nonstop.perf import recorder, report, timeline
from nonstop.perf.events import Event

MS = 1_000_000

# The synthetic pipeline's schedule (seconds). Episodes run one at a time: per turn the engine
# decodes STEPS steps, then the episode waits on a tool; after TURNS turns a reward. Every GROUP
# episodes the trainer gets a group: one step, then a weight sync. Every phase sleeps until its
# scheduled end (not for a fixed time), so a late wake-up on a loaded machine shifts one boundary
# instead of every later one.
DECODE, STEPS, TOOL, TURNS, REWARD = 0.040, 2, 0.120, 2, 0.040
EPISODES, GROUP, TRAIN, SYNC = 6, 2, 0.240, 0.040
SLOTS = 4  # tokens per decode step
FLOPS, PEAK = 1e9, 1e10
GENERATION = STEPS * DECODE
EPISODE = TURNS * (GENERATION + TOOL) + REWARD  # 0.44 s
TOTAL = EPISODES * EPISODE + TRAIN + SYNC  # 2.92 s: the last group's step ends the run


# A run held the schedule when its phases' late wake-ups add up to under 2% of it: then no
# figure that is a fraction of the run moved by more than that.
LATE_BUDGET = 0.02 * TOTAL


def _sleep_until(deadline: float, late: list[float]) -> None:
    time.sleep(max(0.0, deadline - time.perf_counter()))
    late.append(time.perf_counter() - deadline)


def _pipeline() -> float:
    """Run the schedule; returns how late, summed, its phases began or ended against the plan,
    measured independently of perf (a loaded machine may not hold the schedule)."""
    late: list[float] = []
    requests: queue.Queue = queue.Queue()
    groups: queue.Queue = queue.Queue()
    t0 = time.perf_counter() + 0.05  # every thread is waiting by then

    def engine() -> None:
        while (req := requests.get()) is not None:  # blocking get: idle, no span
            loop, fut, start = req
            late.append(time.perf_counter() - start)
            for i in range(STEPS):
                perf.gauge(perf.ENGINE_QUEUE_DEPTH, 0)
                with perf.span(perf.ROLLOUT_DECODE, step=i):
                    with perf.device_busy(perf.ENGINE):
                        _sleep_until(start + (i + 1) * DECODE, late)
                perf.count(perf.ENGINE_TOKENS, SLOTS)
            loop.call_soon_threadsafe(fut.set_result, None)

    def trainer() -> None:
        _sleep_until(t0, late)
        for step in range(EPISODES // GROUP):
            with perf.span(perf.TRAIN_DATA_WAIT, step=step):
                group = groups.get()
            ready = t0 + (step + 1) * GROUP * EPISODE
            late.append(time.perf_counter() - ready)
            perf.gauge(perf.GROUP_QUEUE_DEPTH, groups.qsize())
            for staleness in group:
                perf.gauge(perf.TRAIN_STALENESS, staleness)
            with perf.span(perf.TRAIN_STEP, step=step):
                with perf.device_busy(perf.TRAINER, step=step):
                    _sleep_until(ready + TRAIN, late)
            perf.count(perf.TRAIN_FLOPS, FLOPS)
            with perf.span(perf.TRAIN_WEIGHT_SYNC, step=step):
                _sleep_until(ready + TRAIN + SYNC, late)

    async def episode(k: int) -> None:
        loop = asyncio.get_running_loop()
        for turn in range(TURNS):
            start = t0 + k * EPISODE + turn * (GENERATION + TOOL)
            with perf.span(report.GENERATE, episode=k, turn=turn):
                fut = loop.create_future()
                requests.put((loop, fut, start))
                await fut
            with perf.span(perf.ROLLOUT_TOOL_WAIT, episode=k, turn=turn):
                # The loop's timers wake ~1 ms late: sleep short, then to the deadline.
                await asyncio.sleep(start + GENERATION + TOOL - time.perf_counter() - 0.003)
                _sleep_until(start + GENERATION + TOOL, late)
        with perf.span(perf.ROLLOUT_REWARD, episode=k):
            _sleep_until(t0 + (k + 1) * EPISODE, late)
        perf.count(perf.ROLLOUT_EPISODES)

    async def orchestrator() -> None:
        _sleep_until(t0, late)
        done = []
        for k in range(EPISODES):
            await asyncio.create_task(episode(k), name=f"ep{k}")
            done.append(k % GROUP)  # staleness of each episode: 0, 1, 0, 1, …
            if len(done) == GROUP:
                groups.put(done)
                perf.gauge(perf.GROUP_QUEUE_DEPTH, groups.qsize())
                done = []

    threads = [
        threading.Thread(target=trainer, name="trainer-loop"),
        threading.Thread(target=engine, name="engine-scheduler"),
    ]
    for t in threads:
        t.start()
    asyncio.run(orchestrator())
    requests.put(None)
    for t in threads:
        t.join()
    return sum(max(0.0, x) for x in late)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """(run directory, summed lateness): the first of up to three runs that held the schedule."""
    previous = recorder.STATE.base_config
    perf.configure(perf.PerfConfig())
    try:
        for _ in range(3):
            path = tmp_path_factory.mktemp("pipeline")
            with perf.run(path, perf.PerfConfig(flush_interval_s=0.05, scalars_every_s=60.0)):
                late = _pipeline()
            if late <= LATE_BUDGET:
                break
    finally:
        perf.configure(previous)
    return path, late


@pytest.fixture(scope="module")
def run_dir(pipeline):
    return pipeline[0]


@pytest.fixture(scope="module")
def rep(run_dir):
    return perf.build_report(run_dir, peak_flops_per_s=PEAK)


def test_figures_match_the_known_schedule(rep, pipeline):
    if pipeline[1] > LATE_BUDGET:
        pytest.skip(f"machine too loaded to hold the schedule: phases {pipeline[1]:.3f} s late")
    assert rep.complete and rep.problems == []
    assert rep.window_s == pytest.approx(TOTAL, rel=0.02)
    engine, trainer = rep.roles["engine"], rep.roles["trainer"]
    n_steps = EPISODES * TURNS * STEPS
    # Engine: decoding, idle while the single episode waits on a tool or is scored, and
    # finished after its last step (the last tool wait, reward, step and sync follow it).
    assert engine.busy == pytest.approx(n_steps * DECODE / TOTAL, abs=0.02)
    assert engine.busy_in[perf.ROLLOUT_DECODE] == pytest.approx(engine.busy, abs=1e-9)
    assert engine.idle[perf.ROLLOUT_TOOL_WAIT] == pytest.approx(
        (EPISODES * TURNS - 1) * TOOL / TOTAL, abs=0.02
    )
    assert engine.idle[perf.ROLLOUT_REWARD] == pytest.approx(
        (EPISODES - 1) * REWARD / TOTAL, abs=0.02
    )
    assert engine.idle[report.AFTER_END] == pytest.approx(
        (TOOL + REWARD + TRAIN + SYNC) / TOTAL, abs=0.02
    )
    # Other cross causes only take the handoff slivers between spans.
    assert {c for c in engine.cross if engine.idle[c] > 0.01} == {
        perf.ROLLOUT_TOOL_WAIT,
        perf.ROLLOUT_REWARD,
    }
    # Trainer: waits 2 episodes for the first group, then 2 episodes less a step and a sync.
    groups = EPISODES // GROUP
    wait = GROUP * EPISODE + (groups - 1) * (GROUP * EPISODE - TRAIN - SYNC)
    assert trainer.busy == pytest.approx(groups * TRAIN / TOTAL, abs=0.02)
    assert trainer.busy_in == pytest.approx({perf.TRAIN_STEP: trainer.busy})
    assert trainer.idle[perf.TRAIN_DATA_WAIT] == pytest.approx(wait / TOTAL, abs=0.02)
    assert trainer.idle[perf.TRAIN_WEIGHT_SYNC] == pytest.approx(groups * SYNC / TOTAL, abs=0.02)
    # Episodes: generation, tools and reward, per 0.44 s episode.
    ep = rep.episodes
    assert ep.count == EPISODES and ep.mean_s == pytest.approx(EPISODE, rel=0.02)
    assert ep.causes[perf.ROLLOUT_TOOL_WAIT] == pytest.approx(TURNS * TOOL / EPISODE, abs=0.02)
    assert ep.causes[report.GENERATE] == pytest.approx(TURNS * STEPS * DECODE / EPISODE, abs=0.02)
    assert ep.causes[perf.ROLLOUT_REWARD] == pytest.approx(REWARD / EPISODE, abs=0.02)
    # Per-stage table: exact counts, utilisation (total over the window) within 2%; medians
    # within 2% or 2 ms, whichever is more (a phase that starts late by its predecessor's late
    # wake-up still ends on its deadline, so it is short by that wake-up: 1.4 ms seen in CI).
    expected = {
        perf.ROLLOUT_DECODE: (n_steps, DECODE),
        perf.ENGINE_BUSY: (n_steps, DECODE),
        perf.ROLLOUT_TOOL_WAIT: (EPISODES * TURNS, TOOL),
        perf.ROLLOUT_REWARD: (EPISODES, REWARD),
        report.GENERATE: (EPISODES * TURNS, STEPS * DECODE),
        perf.TRAIN_STEP: (groups, TRAIN),
        perf.TRAIN_WEIGHT_SYNC: (groups, SYNC),
    }
    for name, (count, seconds) in expected.items():
        st = rep.stages[name]
        assert st.count == count, name
        assert st.total_s / TOTAL == pytest.approx(count * seconds / TOTAL, abs=0.02), name
        assert st.p50_s == pytest.approx(seconds, abs=max(0.02 * seconds, 0.002)), name
    assert rep.stages[perf.TRAIN_DATA_WAIT].count == groups
    assert rep.stages[perf.ROLLOUT_TOOL_WAIT].occupancy == pytest.approx(
        EPISODES * TURNS * TOOL / TOTAL, abs=0.02
    )
    # Rates, totals, queues, staleness, MFU.
    assert rep.totals[perf.ENGINE_TOKENS] == n_steps * SLOTS
    assert rep.rates[perf.ENGINE_TOKENS] == pytest.approx(n_steps * SLOTS / TOTAL, rel=0.02)
    assert rep.rates[perf.ROLLOUT_EPISODES] == pytest.approx(EPISODES / TOTAL, rel=0.02)
    assert rep.staleness == {0.0: groups, 1.0: groups}
    assert (
        rep.gauges[perf.GROUP_QUEUE_DEPTH].max == 1 and rep.gauges[perf.ENGINE_QUEUE_DEPTH].max == 0
    )
    assert rep.mfu == pytest.approx(groups * FLOPS / TOTAL / PEAK, rel=0.02)


def test_each_role_is_at_least_95_percent_attributed(rep):
    assert set(rep.roles) == {"engine", "trainer"}
    for rt in rep.roles.values():
        assert rt.attributed >= 0.95, (rt.role, rt.unattributed)
        # Busy, named idle causes and unattributed partition the window.
        assert sum(rt.busy_in.values()) == pytest.approx(rt.busy, abs=1e-9)
        assert rt.busy + sum(rt.idle.values()) + rt.unattributed == pytest.approx(1.0, abs=1e-9)
    assert rep.episodes.unattributed <= 0.05


def test_findings_and_advice_name_who_waited_on_whom(rep):
    trainer_wait = rep.roles["trainer"].idle[perf.TRAIN_DATA_WAIT]
    tools = rep.episodes.causes[perf.ROLLOUT_TOOL_WAIT]
    engine_tools = rep.roles["engine"].idle[perf.ROLLOUT_TOOL_WAIT]
    assert (
        f"the trainer waited {100 * trainer_wait:.1f}% of the time for groups (train/data_wait)"
        in rep.findings
    )
    assert f"{100 * tools:.1f}% of episode time was tool wait (rollout/tool_wait)" in rep.findings
    assert (
        f"the engine was idle {100 * engine_tools:.1f}% of the time: no requests: episodes "
        "waiting on tools (rollout/tool_wait)" in rep.findings
    )
    assert len(rep.advice) == 1 and rep.advice[0].startswith("raise max_concurrency")
    text = rep.text()
    for line in rep.findings + rep.advice:
        assert line in text
    assert "model FLOPs utilisation" in text and "trace.json" in text
    decoded = json.loads(json.dumps(rep.to_json()))
    assert decoded["roles"]["engine"]["attributed"] == pytest.approx(rep.roles["engine"].attributed)


def test_trace_of_the_pipeline_loads_with_rollout_and_training_tracks(run_dir):
    trace = perf.load_trace(str(run_dir / "trace.json"))
    assert trace.roles == ["engine", "rollout", "trainer"]
    assert {perf.ENGINE_BUSY, perf.ROLLOUT_DECODE} <= {e["name"] for e in trace.spans["engine"]}
    assert perf.TRAINER_BUSY in {e["name"] for e in trace.spans["trainer"]}
    assert len({e["tid"] for e in trace.spans["rollout"]}) == EPISODES


# Hand-built: engine busy 100-200 and 400-500 ms on thread 1 (decode spans around each, 5 ms of
# host work after the first), episodes on thread 9 wait on tools 200-350 and score 350-390,
# the trainer's weight sync 480-600 ms. Window 0-600 ms; the engine's first event is at 100.
def X(name, t0, t1, tid=1, task=0):
    return Event("X", name, perf.role_of(name), t0 * MS, t1 * MS, tid=tid, task_key=task)


HAND = [
    X(perf.ROLLOUT_DECODE, 100, 205),
    X(perf.ENGINE_BUSY, 100, 200),
    X(perf.ROLLOUT_DECODE, 400, 500),
    X(perf.ENGINE_BUSY, 400, 500),
    X(perf.ROLLOUT_TOOL_WAIT, 200, 350, tid=9, task=5),
    X(perf.ROLLOUT_REWARD, 350, 390, tid=9, task=5),
    X(perf.TRAIN_DATA_WAIT, 0, 480, tid=2),
    X(perf.TRAIN_WEIGHT_SYNC, 480, 600, tid=2),
    # A batch learner collecting on the trainer's own thread (rollout role, same thread):
    X(perf.ROLLOUT_QUEUE_WAIT, 0, 60, tid=3),
    X(perf.TRAINER_BUSY, 60, 100, tid=3),
]


def test_attribution_is_exact_on_a_hand_built_timeline():
    engine = perf.attribute_role(HAND, "engine", (0, 600 * MS))
    assert engine.busy == pytest.approx(200 / 600)
    assert engine.busy_in == pytest.approx({perf.ROLLOUT_DECODE: 200 / 600})
    # Idle 0-100 (not started), 200-205 (own host work in decode), 205-350 tools, 350-390
    # reward, 390-400 unexplained, 500-600: after the engine's last event.
    assert engine.idle == pytest.approx(
        {
            report.BEFORE_START: 100 / 600,
            report.AFTER_END: 100 / 600,
            perf.ROLLOUT_DECODE: 5 / 600,
            perf.ROLLOUT_TOOL_WAIT: 145 / 600,
            perf.ROLLOUT_REWARD: 40 / 600,
        }
    )
    assert list(engine.idle)[:2] == [report.BEFORE_START, report.AFTER_END]
    assert engine.cross == (perf.ROLLOUT_TOOL_WAIT, perf.ROLLOUT_REWARD)
    assert engine.unattributed == pytest.approx(10 / 600)
    assert engine.cause_text(perf.ROLLOUT_DECODE) == "host work around decode (rollout/decode)"
    # The trainer: its own thread's rollout/queue_wait counts as its own cause.
    trainer = perf.attribute_role(HAND, "trainer", (0, 600 * MS))
    assert trainer.busy == pytest.approx(40 / 600)
    assert trainer.idle == pytest.approx(
        {perf.TRAIN_DATA_WAIT: 480 / 600 - 40 / 600, perf.TRAIN_WEIGHT_SYNC: 120 / 600}
    )
    # data_wait covered 0-60 before queue_wait could; without it the learner thread's own
    # collection explains 0-60 (and counts as the trainer's start).
    no_wait = [e for e in HAND if e.name != perf.TRAIN_DATA_WAIT]
    trainer = perf.attribute_role(no_wait, "trainer", (0, 600 * MS))
    assert trainer.idle[perf.ROLLOUT_QUEUE_WAIT] == pytest.approx(60 / 600)
    assert perf.ROLLOUT_QUEUE_WAIT not in trainer.cross
    # Cross: the engine had the device 100-200 and 400-480 (480-600 is the weight sync).
    assert trainer.idle[perf.ENGINE_BUSY] == pytest.approx(180 / 600)
    assert trainer.unattributed == pytest.approx(200 / 600)
    # Episodes: the track of thread 9 only (thread 3 records device busy: a learner, not an
    # episode), 190 ms of tools and reward.
    ep = perf.attribute_episodes(HAND)
    assert ep.count == 1 and ep.total_s == pytest.approx(0.19)
    assert ep.causes == pytest.approx(
        {perf.ROLLOUT_TOOL_WAIT: 150 / 190, perf.ROLLOUT_REWARD: 40 / 190}
    )


def _read_png(path):
    """Pixels of the PNG at `path`, as Pillow decodes it."""
    with Image.open(path) as img:
        assert img.format == "PNG" and img.mode == "RGB"
        return np.asarray(img)


def test_timeline_png_draws_busy_and_stage_intervals_where_they_happened(run_dir, tmp_path):
    log = perf.read_events(str(run_dir))
    out = str(tmp_path / "t.png")
    tl = perf.render_timeline(log.events, out, thread_names=log.thread_names, title="pipeline")
    pixels = _read_png(out)
    assert pixels.shape == (tl.height, tl.width, 3)
    busy = sorted((e for e in log.events if e.name == perf.ENGINE_BUSY), key=lambda e: e.t0)
    tools = sorted((e for e in log.events if e.name == perf.ROLLOUT_TOOL_WAIT), key=lambda e: e.t0)
    top, bottom = tl.rows["engine device busy"]
    mid_row = (top + bottom) // 2
    for e in busy:
        assert tuple(pixels[mid_row, tl.x_of((e.t0 + e.t1) // 2)]) == timeline.BUSY
    for e in tools:  # the engine is idle during every tool wait
        assert tuple(pixels[mid_row, tl.x_of((e.t0 + e.t1) // 2)]) != timeline.BUSY
    episode_rows = [label for label in tl.rows if label.startswith("ep")]
    assert sorted(episode_rows) == [f"ep{k} @ MainThread" for k in range(EPISODES)]
    top, bottom = tl.rows["ep0 @ MainThread"]
    first_tool = tools[0]
    colour = tuple(pixels[(top + bottom) // 2, tl.x_of((first_tool.t0 + first_tool.t1) // 2)])
    assert colour == timeline.STAGE_COLOURS[perf.ROLLOUT_TOOL_WAIT]
    assert {"engine-scheduler", "trainer-loop"} <= set(tl.rows)
    assert tl.hidden_tracks == 0
    # Nested spans are inset: the trainer step row shows the step's colour at the edge and the
    # device-busy colour in the middle.
    top, bottom = tl.rows["trainer-loop"]
    step = next(e for e in log.events if e.name == perf.TRAIN_STEP)
    x = tl.x_of((step.t0 + step.t1) // 2)
    assert tuple(pixels[top + 3, x]) == timeline.STAGE_COLOURS[perf.TRAIN_STEP]
    assert tuple(pixels[(top + bottom) // 2, x]) == timeline.BUSY


def test_crashed_half_written_run_reports_what_it_can_and_what_is_missing(run_dir, tmp_path):
    crashed = tmp_path / "crashed"
    shutil.copytree(run_dir, crashed)
    lines = (crashed / "events.jsonl").read_text().splitlines(keepends=True)
    assert '"ph":"E"' in lines[-1]
    cut = len(lines) * 2 // 3  # the crash: the end marker and a third of the events never made it
    (crashed / "events.jsonl").write_text("".join(lines[:cut]) + '{"ph":"X","name":"rollout/de')
    os.remove(crashed / "trace.json")
    os.remove(crashed / "perf_metrics.jsonl")
    shutil.rmtree(crashed / "tensorboard")
    rep = perf.build_report(crashed)
    assert not rep.complete
    problems = "\n".join(rep.problems)
    for what in ("half-written", "no end marker", "trace.json: missing", "perf_metrics.jsonl",
                 "tensorboard"):  # fmt: skip
        assert what in problems, what
    assert rep.files["trace.json"] == "missing" and "incomplete" in rep.files["events.jsonl"]
    assert set(rep.roles) == {"engine", "trainer"} and rep.episodes is not None
    for rt in rep.roles.values():
        assert rt.busy + sum(rt.idle.values()) + rt.unattributed == pytest.approx(1.0, abs=1e-9)
    text = rep.text()
    assert "INCOMPLETE run" in text and "half-written" in text


def test_empty_run_directory_says_there_is_nothing(tmp_path):
    rep = perf.build_report(tmp_path)
    assert rep.roles == {} and rep.episodes is None and rep.stages == {}
    assert any("events.jsonl: missing" in p for p in rep.problems)
    assert "no device-busy intervals recorded" in rep.text()


def test_episode_outcomes_come_before_any_advice(tmp_path):
    """A run whose episodes mostly ended context_full: the report counts each outcome and its
    first advice says so, before any advice on speed."""
    with perf.run(tmp_path):
        for status, n in (("context_full", 7), ("done", 2), ("error", 1)):
            for _ in range(n):
                perf.count(perf.ROLLOUT_EPISODE_STATUS, 1, status=status)
        with perf.span(perf.ROLLOUT_DECODE), perf.device_busy(perf.ENGINE):
            time.sleep(0.01)
    rep = perf.build_report(tmp_path)
    assert rep.outcomes == {"context_full": 7, "done": 2, "error": 1}
    assert rep.advice[0].startswith("70.0% of episodes ended context_full")
    assert "raise engine.max_len" in rep.advice[0]
    assert rep.advice[1].startswith("10.0% of episodes failed")
    text = rep.text()
    assert "episode outcomes: context_full 7, done 2, error 1" in text
    assert text.index("episode outcomes:") < text.index("advice:")
    assert json.loads(json.dumps(rep.to_json()))["outcomes"]["context_full"] == 7
