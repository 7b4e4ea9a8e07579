"""The timeline PNG on a hand-built run, read back with Pillow: size, lanes, spans, legend."""

import numpy as np
import pytest
from PIL import Image

from nonstop import perf
from nonstop.perf import timeline
from nonstop.perf.events import Event

MS = 1_000_000


def _span(name, role, t0_ms, t1_ms, tid, task=None, task_key=0):
    return Event(ph="X", name=name, role=role, t0=t0_ms * MS, t1=t1_ms * MS, tid=tid, task=task,
                 task_key=task_key)  # fmt: skip


EVENTS = [
    _span(perf.TRAIN_STEP, "trainer", 100, 500, tid=1),
    _span(perf.TRAINER_BUSY, "trainer", 200, 400, tid=1),  # nested: inset inside the step
    _span(perf.TRAIN_WEIGHT_SYNC, "trainer", 500, 600, tid=1),
    _span(perf.ROLLOUT_DECODE, "rollout", 0, 300, tid=2, task="ep0", task_key=1),
    _span(perf.ROLLOUT_TOOL_WAIT, "rollout", 300, 700, tid=2, task="ep0", task_key=1),
    _span(perf.ROLLOUT_DECODE, "rollout", 50, 250, tid=2, task="ep1", task_key=2),
    _span(perf.ENGINE_BUSY, "engine", 0, 250, tid=3),
    _span(perf.ENGINE_BUSY, "engine", 650, 800, tid=3),
]


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("timeline") / "t.png")
    tl = perf.render_timeline(EVENTS, path, thread_names={1: "trainer-loop", 2: "MainThread",
                                                          3: "engine-scheduler"},
                              title="hand-built", width=900)  # fmt: skip
    with Image.open(path) as img:
        assert img.format == "PNG" and img.mode == "RGB"
        return tl, np.asarray(img)


def _at(pixels, tl, label, t_ms, row_fraction=0.5):
    top, bottom = tl.rows[label]
    return tuple(int(c) for c in pixels[top + round((bottom - top - 1) * row_fraction),
                                        tl.x_of(t_ms * MS)])  # fmt: skip


def test_size_matches_what_render_timeline_reports(drawn):
    tl, pixels = drawn
    assert pixels.shape == (tl.height, tl.width, 3) and tl.width == 900
    assert tl.window == (0, 800 * MS) and tl.hidden_tracks == 0


def test_one_lane_per_track_grouped_by_role(drawn):
    tl, _ = drawn
    assert list(tl.rows) == ["engine device busy", "engine-scheduler", "trainer device busy",
                             "trainer-loop", "ep0 @ MainThread", "ep1 @ MainThread"]  # fmt: skip
    tops = [top for top, _ in tl.rows.values()]
    assert tops == sorted(tops) and len(set(tops)) == len(tops)


def test_spans_are_drawn_in_their_stage_colour_where_they_happened(drawn):
    tl, pixels = drawn
    colours = timeline.STAGE_COLOURS
    assert _at(pixels, tl, "ep0 @ MainThread", 150) == colours[perf.ROLLOUT_DECODE]
    assert _at(pixels, tl, "ep0 @ MainThread", 500) == colours[perf.ROLLOUT_TOOL_WAIT]
    assert _at(pixels, tl, "ep1 @ MainThread", 520) == timeline.BACKGROUND  # ep1 ended at 250
    assert _at(pixels, tl, "trainer-loop", 550) == colours[perf.TRAIN_WEIGHT_SYNC]
    # The nested device-busy span sits inset in the step: step colour at the edge, busy inside.
    assert _at(pixels, tl, "trainer-loop", 300, row_fraction=0.2) == colours[perf.TRAIN_STEP]
    assert _at(pixels, tl, "trainer-loop", 300) == timeline.BUSY
    assert _at(pixels, tl, "trainer-loop", 150) == colours[perf.TRAIN_STEP]


def test_device_busy_lane_is_the_union_of_busy_intervals(drawn):
    tl, pixels = drawn
    assert _at(pixels, tl, "engine device busy", 100) == timeline.BUSY
    assert _at(pixels, tl, "engine device busy", 700) == timeline.BUSY
    assert _at(pixels, tl, "engine device busy", 450) != timeline.BUSY  # idle between them


def test_labels_axis_and_legend_have_ink(drawn):
    tl, pixels = drawn
    top, bottom = tl.rows["trainer-loop"]
    label = pixels[top:bottom, : tl.plot_x[0] - 4]
    assert (label != timeline.BACKGROUND).any(axis=-1).sum() > 20  # the label's text
    below = pixels[bottom:]
    for colour in tl.colours.values():  # every stage has a legend swatch under the plot
        assert (below == colour).all(axis=-1).sum() >= 12 * 8 - 16
    axis_row = max(b for _, b in tl.rows.values())
    assert (pixels[axis_row, tl.plot_x[0]:tl.plot_x[1] + 1] == timeline.INK).all()


def test_write_png_round_trips_through_pillow(tmp_path):
    rgb = np.random.default_rng(0).integers(0, 256, (7, 11, 3), dtype=np.uint8)
    perf.write_png(str(tmp_path / "x.png"), rgb)
    with Image.open(tmp_path / "x.png") as img:
        np.testing.assert_array_equal(np.asarray(img), rgb)
    with pytest.raises(ValueError, match=r"uint8\[H, W, 3\]"):
        perf.write_png(str(tmp_path / "y.png"), rgb[..., :2])
