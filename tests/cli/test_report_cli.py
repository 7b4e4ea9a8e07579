"""`nonstop report RUN_DIR`: text, JSON and PNG from a real recorded run, a crashed run (with
--write-trace rebuilding its trace), and a directory with nothing in it."""

import json
import os
import time

import pytest

from nonstop import perf
from nonstop.cli.main import main
from nonstop.perf import recorder


@pytest.fixture
def run_dir(tmp_path):
    """Two engine steps of 30 ms with a 20 ms tool wait between them, one 30 ms train step."""
    previous = recorder.STATE.base_config
    cfg = perf.PerfConfig(tensorboard=False, scalars_every_s=60.0)
    try:
        with perf.run(tmp_path / "run", cfg):
            for i in range(2):
                with perf.span(perf.ROLLOUT_DECODE, step=i):
                    with perf.device_busy(perf.ENGINE):
                        time.sleep(0.03)
                perf.count(perf.ENGINE_TOKENS, 5)
                if i == 0:
                    with perf.span(perf.ROLLOUT_TOOL_WAIT):
                        time.sleep(0.02)
            with perf.span(perf.TRAIN_STEP):
                with perf.device_busy(perf.TRAINER):
                    time.sleep(0.03)
            perf.count(perf.TRAIN_FLOPS, 1e6)
    finally:
        perf.configure(previous)
    return tmp_path / "run"


def test_text_report_and_timeline(run_dir, capsys):
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"nonstop report: {run_dir}")
    assert "where time went:" in out and "engine   busy" in out
    assert "no requests: episodes waiting on tools (rollout/tool_wait)" in out
    assert "tensorboard/: missing" in out  # disabled in this run, and said so
    assert f"timeline: {run_dir / 'timeline.png'}" in out
    assert (run_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_report_with_png_path_and_peak(run_dir, tmp_path, capsys):
    png = tmp_path / "elsewhere.png"
    assert (
        main(["report", str(run_dir), "--json", "--png", str(png), "--peak-flops-per-s", "1e8"])
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["timeline_png"] == str(png) and png.exists()
    engine = doc["roles"]["engine"]
    # 60 ms busy in a ~110 ms window (30 busy, 20 tool, 30 busy, 30 trainer step after).
    assert engine["busy"] == pytest.approx(60 / 110, abs=0.05)
    assert engine["attributed"] >= 0.95
    assert doc["totals"]["engine/tokens"] == 10
    assert doc["mfu"] == pytest.approx(1e6 / doc["window_s"] / 1e8, rel=1e-6)
    assert not (run_dir / "timeline.png").exists()


def test_crashed_run_reports_and_write_trace_rebuilds_the_trace(run_dir, capsys):
    lines = (run_dir / "events.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "events.jsonl").write_text("".join(lines[:-1]) + '{"ph":"C","na')
    os.remove(run_dir / "trace.json")
    assert main(["report", str(run_dir), "--no-png"]) == 0
    out = capsys.readouterr().out
    assert "INCOMPLETE run" in out and "trace.json: missing" in out and "half-written" in out
    assert not (run_dir / "timeline.png").exists()
    assert main(["report", str(run_dir), "--no-png", "--write-trace"]) == 0
    out = capsys.readouterr().out
    assert "trace.json: missing" not in out
    trace = perf.load_trace(str(run_dir / "trace.json"))
    assert set(trace.roles) == {"engine", "rollout", "trainer"}
    assert not trace.other["complete"]


def test_empty_directory_and_bad_arguments(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "events.jsonl: missing" in captured.out and "no events" in captured.err
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "nope' does not exist; pass a run directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path), "--peak-flops-per-s", "-1"]) == 2
