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


def test_the_tool_demo_fraction_is_validated_and_shapes_the_demonstrations(tmp_path):
    from nonstop.agentic.envs.calculator import CalculatorConfig
    from nonstop.models.validation import ConfigError
    from nonstop.recipes.demo import DemoConfig, write_demonstrations

    with pytest.raises(ConfigError, match=r"DemoConfig\.tool_demo_fraction=1\.5 is invalid"):
        DemoConfig(tool_demo_fraction=1.5)
    kinds = {}
    for fraction in (0.0, 0.5, 1.0):
        path = tmp_path / f"{fraction}.jsonl"
        write_demonstrations(path, CalculatorConfig(max_operand=20), n=200, seed=0,
                             tool_fraction=fraction)
        demos = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
        # system, user, then either the call, the tool's result and the answer, or the answer
        kinds[fraction] = [[m["role"] for m in d[2:]] for d in demos]
        for demo, roles in zip(demos, kinds[fraction], strict=True):
            assert roles in (["assistant"], ["assistant", "tool", "assistant"])
            assert demo[-1]["content"] and demo[-1]["content"].lstrip("-").isdigit()
    assert all(len(r) == 1 for r in kinds[0.0]) and all(len(r) == 3 for r in kinds[1.0])
    assert 70 < sum(len(r) == 3 for r in kinds[0.5]) < 130
    # the same problems in the same order whatever the share: only the answers' form changes
    problems = {f: [json.loads(line)["messages"][1]["content"]
                    for line in (tmp_path / f"{f}.jsonl").read_text().splitlines()]
                for f in (0.0, 0.5, 1.0)}
    assert problems[0.0] == problems[0.5] == problems[1.0]
