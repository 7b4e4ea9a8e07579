"""Derived figures: exact on hand-built timelines, within 2% on a live timeline of known sleeps."""

import threading
import time

import pytest

from nonstop import perf
from nonstop.perf import analysis
from nonstop.perf.events import Event

MS = 1_000_000


def X(name, t0, t1, **tags):
    return Event("X", name, perf.role_of(name), t0 * MS, t1 * MS, tags=tags)


def C(name, t, value):
    return Event("C", name, perf.role_of(name), t * MS, t * MS, value=value)


def G(name, t, value):
    return Event("G", name, perf.role_of(name), t * MS, t * MS, value=value)


def test_interval_algebra():
    assert analysis.merge([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]
    assert analysis.subtract([(0, 10), (20, 30)], [(2, 3), (5, 22), (29, 40)]) == [
        (0, 2), (3, 5), (22, 29),
    ]  # fmt: skip
    assert analysis.clip([(0, 5), (8, 12), (20, 21)], (3, 10)) == [(3, 5), (8, 10)]


# Trainer over a 1000 ms window:
#   device_busy 100-300, 500-700                          → busy 400 ms
#   data_wait   0-100, 300-450;  weight_sync 400-500       (overlaps data_wait 400-450)
#   checkpoint  650-800  (inside busy 650-700: only 700-800 is idle time)
#   idle = 0-100, 300-500, 700-1000 = 600 ms:
#     data_wait 0-100 + 300-450 = 250, weight_sync 450-500 = 50, checkpoint 700-800 = 100,
#     unattributed 800-1000 = 200.
TRAINER = [
    X(perf.TRAINER_BUSY, 100, 300),
    X(perf.TRAINER_BUSY, 500, 700),
    X(perf.TRAIN_DATA_WAIT, 0, 100),
    X(perf.TRAIN_DATA_WAIT, 300, 450),
    X(perf.TRAIN_WEIGHT_SYNC, 400, 500),
    X(perf.TRAIN_CHECKPOINT, 650, 800),
]
WINDOW = (0, 1000 * MS)


def test_idle_breakdown_exact():
    idle = perf.idle_breakdown(TRAINER, perf.TRAINER, WINDOW)
    assert idle.busy == pytest.approx(0.4, abs=1e-12)
    assert idle.idle == pytest.approx(0.6, abs=1e-12)
    assert idle.causes == pytest.approx(
        {perf.TRAIN_DATA_WAIT: 0.25, perf.TRAIN_WEIGHT_SYNC: 0.05, perf.TRAIN_CHECKPOINT: 0.1}
    )
    assert idle.unattributed == pytest.approx(0.2, abs=1e-12)
    # Priority follows the order given: weight_sync first takes 400-500 whole.
    swapped = perf.idle_breakdown(
        TRAINER, perf.TRAINER, WINDOW, causes=[perf.TRAIN_WEIGHT_SYNC, perf.TRAIN_DATA_WAIT]
    )
    assert swapped.causes == pytest.approx({perf.TRAIN_WEIGHT_SYNC: 0.1, perf.TRAIN_DATA_WAIT: 0.2})
    assert swapped.unattributed == pytest.approx(0.3, abs=1e-12)


def test_busy_fraction_merges_overlaps_and_clips():
    events = [
        X(perf.ENGINE_BUSY, 0, 60),
        X(perf.ENGINE_BUSY, 40, 100),
        X(perf.ENGINE_BUSY, 150, 250),
    ]
    assert perf.busy_fraction(events, perf.ENGINE, (0, 200 * MS)) == pytest.approx(150 / 200)
    assert perf.busy_fraction(events, perf.ENGINE) == pytest.approx(200 / 250)  # whole span
    assert perf.busy_fraction(events, perf.TRAINER, (0, 200 * MS)) == 0.0


def test_stage_stats_rates_gauges_histogram_mfu():
    events = [
        X(perf.ROLLOUT_TOOL_WAIT, 0, 100, episode=0),
        X(perf.ROLLOUT_TOOL_WAIT, 50, 250, episode=1),
        X(perf.ROLLOUT_TOOL_WAIT, 300, 400, episode=2),
        C(perf.ENGINE_TOKENS, 10, 30),
        C(perf.ENGINE_TOKENS, 390, 50),
        C(perf.ENGINE_TOKENS, 500, 999),  # outside the 400 ms window, inside the 1000 ms one
        G(perf.ENGINE_QUEUE_DEPTH, 0, 4),
        G(perf.ENGINE_QUEUE_DEPTH, 100, 2),
        G(perf.ENGINE_QUEUE_DEPTH, 300, 8),
        C(perf.TRAIN_FLOPS, 200, 4e12),
        G(perf.TRAIN_STALENESS, 10, 0),
        G(perf.TRAIN_STALENESS, 20, 1),
        G(perf.TRAIN_STALENESS, 30, 1),
        G(perf.TRAIN_STALENESS, 40, 3),
    ]
    window = (0, 400 * MS)
    st = perf.stage_stats(events, window)[perf.ROLLOUT_TOOL_WAIT]
    assert (st.count, st.role) == (3, "rollout")
    assert st.total_s == pytest.approx(0.4)
    assert st.mean_s == pytest.approx(0.4 / 3)
    assert st.p50_s == pytest.approx(0.1) and st.max_s == pytest.approx(0.2)
    assert st.p99_s == pytest.approx(0.1 + 0.98 * 0.1)  # linear interpolation of (0.1, 0.1, 0.2)
    assert st.occupancy == pytest.approx(350 / 400)  # 0-250 and 300-400
    assert st.concurrency == pytest.approx(400 / 400)
    assert perf.rate(events, perf.ENGINE_TOKENS, window) == pytest.approx(80 / 0.4)
    q = perf.gauge_stats(events, window)[perf.ENGINE_QUEUE_DEPTH]
    assert q.count == 3 and q.mean == pytest.approx(14 / 3) and q.max == 8 and q.last == 8
    assert q.time_mean == pytest.approx((4 * 100 + 2 * 200 + 8 * 100) / 400)
    # A window starting after a sample uses the value holding at its start.
    later = perf.gauge_stats(events, (200 * MS, 400 * MS))[perf.ENGINE_QUEUE_DEPTH]
    assert later.time_mean == pytest.approx((2 * 100 + 8 * 100) / 200) and later.count == 1
    assert perf.histogram(events) == {0.0: 1, 1.0: 2, 3.0: 1}
    assert perf.mfu(events, peak_flops_per_s=1e14, window=window) == pytest.approx(0.1)
    figures = perf.summarize(events + TRAINER, window=WINDOW, peak_flops_per_s=1e14, dropped=3)
    scalars = figures.scalars()
    assert scalars["busy/trainer"] == pytest.approx(0.4)
    assert scalars["idle/trainer/train/data_wait"] == pytest.approx(0.25)
    assert scalars["rate/engine/tokens_per_s"] == pytest.approx((30 + 50 + 999) / 1.0)
    assert scalars["staleness/mean"] == pytest.approx(5 / 4)
    assert scalars["mfu"] == pytest.approx(4e12 / 1e14)
    assert scalars["perf/dropped"] == 3


def test_live_timeline_fractions_within_two_percent(fresh):
    """Trainer: data_wait 40 ms → busy 80 ms → weight_sync 20 ms, three times (busy 4/7);
    engine: busy 30 ms, idle 10 ms, four times (busy 3/4). Truth is the test's own clock read
    around each sleep (a loaded machine oversleeps; perf must report what happened), and that
    truth is itself near the schedule."""
    rec = fresh()
    phases: dict[str, float] = {"wait": 0.0, "busy": 0.0, "sync": 0.0}
    engine_phases: dict[str, float] = {"busy": 0.0, "idle": 0.0}

    def timed(table: dict[str, float], key: str, seconds: float) -> None:
        t = time.perf_counter()
        time.sleep(seconds)
        table[key] += time.perf_counter() - t

    def trainer() -> None:
        for i in range(3):
            with perf.span(perf.TRAIN_DATA_WAIT, step=i):
                timed(phases, "wait", 0.040)
            with perf.device_busy(perf.TRAINER, step=i):
                timed(phases, "busy", 0.080)
            with perf.span(perf.TRAIN_WEIGHT_SYNC, step=i):
                timed(phases, "sync", 0.020)

    def engine() -> None:
        for i in range(4):
            with perf.device_busy(perf.ENGINE, step=i):
                timed(engine_phases, "busy", 0.030)
            timed(engine_phases, "idle", 0.010)

    threads = [threading.Thread(target=trainer), threading.Thread(target=engine)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(phases.values())
    assert phases["busy"] / total == pytest.approx(80 / 140, abs=0.05)
    events = rec.events()
    trainer_events = [e for e in events if e.role == perf.TRAINER]
    window = analysis.window_of(trainer_events)
    idle = perf.idle_breakdown(events, perf.TRAINER, window)
    assert idle.busy == pytest.approx(phases["busy"] / total, abs=0.02)
    assert idle.causes[perf.TRAIN_DATA_WAIT] == pytest.approx(phases["wait"] / total, abs=0.02)
    assert idle.causes[perf.TRAIN_WEIGHT_SYNC] == pytest.approx(phases["sync"] / total, abs=0.02)
    assert idle.unattributed == pytest.approx(0.0, abs=0.02)
    engine_busy = [e for e in events if e.name == perf.ENGINE_BUSY]
    # The engine's window runs from its first busy start to the end of its last idle sleep.
    last_idle = engine_phases["idle"] / 4
    engine_window = (engine_busy[0].t0, engine_busy[-1].t1 + int(last_idle * 1e9))
    expected = engine_phases["busy"] / sum(engine_phases.values())
    assert expected == pytest.approx(0.75, abs=0.05)
    assert perf.busy_fraction(events, perf.ENGINE, engine_window) == pytest.approx(expected, abs=0.02)
