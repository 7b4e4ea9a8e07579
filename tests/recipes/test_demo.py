"""A shortened `nonstop demo` runs end to end: SFT on calculator demonstrations, then agentic GRPO,
with the greedy solve rate and pass@k on held-out problems before and after; the run directory
holds a trace that parses back with rollout and training tracks. (That agentic GRPO raises the
solve rate is tests/recipes/test_agentic_learning.py, from an SFT model of the demo's full
warm-up; 60 SFT steps barely start to call the tool.)"""

from __future__ import annotations

import json

import pytest

from nonstop.cli.main import main
from nonstop.perf import load_trace


@pytest.mark.slow
def test_quick_demo_improves_solve_rate(tmp_path, capsys):
    assert main(["demo", "--quick", "--run-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("solve_rate_before_rl", "solve_rate_after_rl", "pass@2_before_rl",
                "pass@2_after_rl"):
        assert 0.0 <= summary[key] <= 1.0, key
    assert summary["rl_steps"] == 4 and 0.0 < summary["engine_busy_fraction"] <= 1.0
    out = capsys.readouterr().out
    assert "solve rate on 24 held-out problems" in out and "Perfetto trace" in out
    assert "pass@2 (one of 2 samples at the training temperature solves it)" in out
    trace = load_trace(str(tmp_path / "perf" / "trace.json"))
    assert {"engine", "rollout", "trainer"} <= set(trace.roles)
    names = {e["name"] for spans in trace.spans.values() for e in spans}
    assert {"rollout/decode", "train/step", "engine/device_busy",
            "trainer/device_busy"} <= names
