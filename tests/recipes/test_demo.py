"""A shortened `nonstop demo`: SFT into a calculator agent, then agentic GRPO raises its solve
rate; the run directory holds a trace that parses back with rollout and training tracks."""

from __future__ import annotations

import json

import pytest

from nonstop.cli.main import main
from nonstop.perf import load_trace


@pytest.mark.slow
def test_quick_demo_improves_solve_rate(tmp_path, capsys):
    assert main(["demo", "--quick", "--run-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["solve_rate_after_rl"] > summary["solve_rate_before_rl"]
    assert 0.0 < summary["engine_busy_fraction"] <= 1.0
    out = capsys.readouterr().out
    assert "solve rate on 24 held-out problems" in out and "Perfetto trace" in out
    trace = load_trace(str(tmp_path / "perf" / "trace.json"))
    assert {"engine", "rollout", "trainer"} <= set(trace.roles)
    names = {e["name"] for spans in trace.spans.values() for e in spans}
    assert {"rollout/decode", "train/step", "engine/device_busy",
            "trainer/device_busy"} <= names
