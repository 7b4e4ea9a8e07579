"""Agentic GRPO raises a calculator agent's held-out solve rate (shortened recipe).

Starts from `tests/fixtures/calculator_sft` (500 SFT steps of `nonstop demo`'s warm-up: 21.9% of
64 held-out problems) and runs the demo's RL phase through the orchestrator and the streaming
learner. `max_staleness=0` makes the run deterministic (the streaming learner then takes exactly
the synchronous learner's steps); the full recipe's figures are in docs/agentic.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nonstop.models import load_pretrained
from nonstop.recipes.agentic_recipe import run_agentic
from nonstop.recipes.demo import DemoConfig

FIXTURE = Path(__file__).parent.parent / "fixtures" / "calculator_sft"


@pytest.mark.slow
def test_agentic_grpo_raises_solve_rate(tmp_path):
    demo = DemoConfig(run_dir=str(tmp_path), rl_steps=40, rl_learning_rate=1e-4,
                      max_staleness=0, progress=False)
    cfg = dataclasses.replace(demo.agentic(), learner="streaming")
    summary = run_agentic(cfg, model=load_pretrained(FIXTURE), progress=False)
    assert summary["solve_rate_before"] == pytest.approx(0.21875)
    assert summary["steps"] == 40
    assert summary["solve_rate_after"] >= summary["solve_rate_before"] + 0.05, summary
