"""Agentic GRPO raises a calculator agent's greedy solve rate on held-out problems (shortened
recipe).

Starts from `tests/fixtures/calculator_sft` (`nonstop demo`'s warm-up: 900 SFT steps on
demonstrations of training-split problems, half of which call the calculator while the other
half state the answer without it) and runs the demo's RL phase, 30 steps instead of 40, through
the orchestrator and the streaming learner; `max_staleness=0` makes the run deterministic. The
SFT model answers some held-out problems with the calculator and the rest without it, and its
mental arithmetic is mostly wrong; GRPO learns from the reward that the calculator pays, so the
greedy solve rate on the 64 held-out problems (none of them trained on, tests/agentic/
test_splits.py) rises by more than the issue's 20 points, and the episodes get longer as every
one of them calls the tool.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from nonstop.models import load_pretrained
from nonstop.recipes.agentic_recipe import run_agentic
from nonstop.recipes.demo import DemoConfig

FIXTURE = Path(__file__).parent.parent / "fixtures" / "calculator_sft"


@pytest.mark.slow
def test_agentic_grpo_raises_the_held_out_solve_rate(tmp_path):
    demo = DemoConfig(run_dir=str(tmp_path), rl_steps=30, max_staleness=0, pass_k=0,
                      progress=False)
    cfg = dataclasses.replace(demo.agentic(), learner="streaming")
    summary = run_agentic(cfg, model=load_pretrained(FIXTURE), progress=False)
    print(summary)
    assert summary["solve_rate_before"] == pytest.approx(36 / 64)
    assert summary["solve_rate_after"] >= summary["solve_rate_before"] + 0.20
    steps = [json.loads(line)
             for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == list(range(1, 31))
    solved = np.asarray([m["solved"] for m in steps])
    assert solved[-10:].mean() >= solved[:10].mean() + 0.2, solved.round(3).tolist()
    # the sampled tokens per episode grow as the direct answers give way to tool calls
    length = np.asarray([m["completion_tokens"] for m in steps])
    assert length[-10:].mean() > 1.5 * length[:10].mean(), length.round(1).tolist()
