"""The timeline picture of a run: a Gantt chart of every role's tracks over time, as a PNG.

One row per track (an OS thread, or an asyncio task on it — the same tracks as the Perfetto
trace), grouped by role (engine, trainer, rollout, then any other). Spans are drawn in their
stage's colour; a nested span is drawn inset inside its parent, so a `rollout/decode` span with
its `engine/device_busy` interval reads as a light bar with a dark core. Each role with
device-busy intervals also gets a summary row of their union. Below: a time axis in seconds and
a legend of the stage colours.

Drawn with Pillow (`ImageDraw` rectangles and lines, `ImageFont.load_default()` for text).
"""

import dataclasses
import zlib
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from nonstop.perf import stages
from nonstop.perf.analysis import Window, merge, window_of
from nonstop.perf.events import Event

RGB = tuple[int, int, int]

BACKGROUND: RGB = (255, 255, 255)
INK: RGB = (40, 40, 40)
GRID: RGB = (225, 225, 225)
BUSY: RGB = (30, 30, 30)  # every `<role>/device_busy` span
STAGE_COLOURS: dict[str, RGB] = {
    stages.ROLLOUT_PREFILL: (66, 133, 244),
    stages.ROLLOUT_DECODE: (120, 170, 250),
    stages.ROLLOUT_TOOL_WAIT: (244, 160, 0),
    stages.ROLLOUT_QUEUE_WAIT: (250, 210, 90),
    stages.ROLLOUT_ENV: (190, 160, 220),
    stages.ROLLOUT_REWARD: (150, 90, 200),
    stages.TRAIN_DATA_WAIT: (230, 90, 70),
    stages.TRAIN_STEP: (60, 170, 90),
    stages.TRAIN_WEIGHT_SYNC: (240, 130, 170),
    stages.TRAIN_CHECKPOINT: (120, 120, 120),
    stages.TRAIN_EVAL: (140, 200, 150),
}
_PALETTE: list[RGB] = [
    (100, 190, 200), (200, 180, 120), (170, 120, 90), (110, 110, 200), (200, 120, 120),
    (120, 200, 120), (180, 180, 60), (90, 150, 150),
]  # fmt: skip
ROLE_ORDER = (stages.ENGINE, stages.TRAINER, stages.ROLLOUT)

ROW_H = 16
LABEL_W = 170
MARGIN = 10


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Where things were drawn, so a reader (or a test) can map times and tracks to pixels."""

    path: str
    width: int
    height: int
    window: Window  # ns on the run's anchor clock
    plot_x: tuple[int, int]  # first and last pixel column of the time axis
    rows: dict[str, tuple[int, int]]  # row label → (top, bottom) pixel rows, bottom exclusive
    colours: dict[str, RGB]  # stage name → its colour
    hidden_tracks: int  # tracks beyond max_tracks_per_role, not drawn

    def x_of(self, t_ns: int) -> int:
        lo, hi = self.window
        x0, x1 = self.plot_x
        return x0 + round((t_ns - lo) / max(hi - lo, 1) * (x1 - x0))


def colour_of(name: str) -> RGB:
    if stages.is_device_busy(name):
        return BUSY
    if name in STAGE_COLOURS:
        return STAGE_COLOURS[name]
    return _PALETTE[zlib.crc32(name.encode()) % len(_PALETTE)]


def _fitted(draw: ImageDraw.ImageDraw, text: str, max_px: float) -> str:
    """`text`, cut short with "~" so that it is at most `max_px` wide."""
    if draw.textlength(text) <= max_px:
        return text
    while text and draw.textlength(text + "~") > max_px:
        text = text[:-1]
    return text + "~"


def _tracks(events: Sequence[Event]) -> dict[tuple[str, int, int, str | None], list[Event]]:
    """Spans by (role, thread, task id, task name: ids of finished tasks are reused), in order
    of first appearance."""
    out: dict[tuple[str, int, int, str | None], list[Event]] = {}
    for e in sorted((e for e in events if e.ph == "X"), key=lambda e: (e.t0, -e.t1)):
        out.setdefault((e.role, e.tid, e.task_key, e.task), []).append(e)
    return out


def _depths(spans: list[Event]) -> list[int]:
    """Nesting depth of each span on one track (sorted by start, longest first)."""
    out, open_ends = [], []
    for e in spans:
        while open_ends and open_ends[-1] <= e.t0:
            open_ends.pop()
        out.append(len(open_ends))
        open_ends.append(e.t1)
    return out


def _role_rank(role: str) -> tuple[int, str]:
    return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), role)


def _tick_step(span_s: float) -> float:
    for step in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120,
                 300, 600, 1800, 3600):  # fmt: skip
        if span_s / step <= 10:
            return step
    return 7200.0


def render_timeline(
    events: Sequence[Event],
    path: str,
    *,
    thread_names: dict[int, str] | None = None,
    title: str = "",
    window: Window | None = None,
    width: int = 1400,
    max_tracks_per_role: int = 16,
) -> Timeline:
    """Draw `events` (spans of a run) as a Gantt chart and write it to `path` as a PNG."""
    if width < LABEL_W + 2 * MARGIN + 100:
        raise ValueError(f"render_timeline: width={width}; valid: >= {LABEL_W + 2 * MARGIN + 100}")
    thread_names = thread_names or {}
    window = window or window_of(events)
    lo, hi = window
    tracks = _tracks(events)
    roles = sorted({key[0] for key in tracks}, key=_role_rank)
    busy_roles = {e.role for e in events if e.ph == "X" and stages.is_device_busy(e.name)}
    layout: list[tuple[str, str, list[Event] | None]] = []  # (role, label, spans or None=busy)
    hidden = 0
    for role in roles:
        if role in busy_roles:
            layout.append((role, f"{role} device busy", None))
        keys = [k for k in tracks if k[0] == role]
        hidden += max(0, len(keys) - max_tracks_per_role)
        for key in keys[:max_tracks_per_role]:
            spans = tracks[key]
            thread = thread_names.get(key[1], f"thread {key[1] % 100000}")
            task = key[3]
            layout.append((role, f"{task} @ {thread}" if task else thread, spans))
    names = sorted({e.name for e in events if e.ph == "X"}, key=lambda n: (stages.role_of(n), n))
    legend_per_line = max(1, (width - 2 * MARGIN) // 190)
    legend_lines = -(-len(names) // legend_per_line) if names else 0
    font = ImageFont.load_default()
    text_h = font.getbbox("Ag")[3]
    header = 2 * MARGIN + text_h
    height = header + len(layout) * ROW_H + len(roles) * 4 + 24 + legend_lines * 14 + MARGIN
    img = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(img)
    x0, x1 = LABEL_W, width - MARGIN - 1
    span_ns = max(hi - lo, 1)

    def x_of(t: int) -> int:
        return x0 + round((min(max(t, lo), hi) - lo) / span_ns * (x1 - x0))

    def bar(a: int, b: int, top: int, bottom: int, colour: RGB) -> None:
        """Pixel columns [a, b) and rows [top, bottom), as numpy slices would say."""
        draw.rectangle((a, top, max(b, a + 1) - 1, bottom - 1), fill=colour)

    draw.text((MARGIN, MARGIN), _fitted(draw, title, width - 2 * MARGIN), fill=INK, font=font)
    step_s = _tick_step(span_ns / 1e9)
    ticks = []
    t = 0.0
    while lo + t * 1e9 <= hi:
        ticks.append((t, x_of(lo + round(t * 1e9))))
        t += step_s
    separators = sum(1 for i in range(1, len(layout)) if layout[i][0] != layout[i - 1][0])
    top_plot, bottom_plot = header, header + len(layout) * ROW_H + separators * 4
    for _, x in ticks:  # grid first: spans drawn later cover it
        draw.line((x, top_plot, x, bottom_plot - 1), fill=GRID)
    y = header
    rows: dict[str, tuple[int, int]] = {}
    previous_role = None
    for role, label, spans in layout:
        if previous_role is not None and role != previous_role:
            draw.line((MARGIN, y + 1, x1, y + 1), fill=GRID)
            y += 4
        previous_role = role
        rows[label if label not in rows else f"{label} #{len(rows)}"] = (y, y + ROW_H)
        draw.text((MARGIN, y + (ROW_H - text_h) // 2), _fitted(draw, label, LABEL_W - MARGIN - 4),
                  fill=INK, font=font)  # fmt: skip
        if spans is None:
            busy_name = stages.device_busy_name(role)
            intervals = merge((e.t0, e.t1) for e in events if e.ph == "X" and e.name == busy_name)
            for a, b in intervals:
                bar(x_of(a), x_of(b), y + 2, y + ROW_H - 2, BUSY)
        else:
            for e, depth in zip(spans, _depths(spans), strict=True):
                inset = min(2 + 3 * depth, ROW_H // 2 - 1)
                bar(x_of(e.t0), x_of(e.t1), y + inset, y + ROW_H - inset, colour_of(e.name))
        y += ROW_H
    for t, x in ticks:
        draw.line((x, bottom_plot, x, bottom_plot + 3), fill=INK)
        label = f"{t:g}s"
        half = draw.textlength(label) / 2
        draw.text((min(max(x - half, 0), width - 2 * half), bottom_plot + 6), label, fill=INK,
                  font=font)  # fmt: skip
    draw.line((x0, bottom_plot, x1, bottom_plot), fill=INK)
    y = bottom_plot + 24
    for i, name in enumerate(names):
        lx = MARGIN + (i % legend_per_line) * 190
        ly = y + (i // legend_per_line) * 14
        bar(lx, lx + 12, ly + 2, ly + 10, colour_of(name))
        draw.text((lx + 16, ly), _fitted(draw, name, 170), fill=INK, font=font)
    img.save(path, format="PNG")
    return Timeline(
        path=path,
        width=width,
        height=height,
        window=window,
        plot_x=(x0, x1),
        rows=rows,
        colours={n: colour_of(n) for n in names},
        hidden_tracks=hidden,
    )


def write_png(path: str, rgb_HWC: np.ndarray) -> None:
    """Write a uint8[H, W, 3] image as an 8-bit RGB PNG."""
    if rgb_HWC.dtype != np.uint8 or rgb_HWC.ndim != 3 or rgb_HWC.shape[2] != 3:
        raise ValueError(f"write_png: need uint8[H, W, 3], got {rgb_HWC.dtype}{rgb_HWC.shape}")
    Image.fromarray(rgb_HWC, "RGB").save(path, format="PNG")
