"""GRPO raises a tiny SFT-initialised model's held-out solve rate (shortened recipe)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nonstop.recipes.config_io import load_config
from nonstop.recipes.rl_recipe import RLRunConfig, run_rl

FIXTURE = Path(__file__).parent.parent / "fixtures" / "arithmetic_sft"


@pytest.mark.slow
def test_grpo_raises_held_out_accuracy(tmp_path):
    cfg = load_config(RLRunConfig, "nonstop/recipes/configs/grpo_arithmetic.yaml", [
        f"run_dir={tmp_path}", f"model.path={FIXTURE}", "warmup.steps=0", "steps=40",
        "eval_every=40", "rollout.group_size=16", "rollout.prompts_per_step=16",
        "optimizer.learning_rate=3e-4", "packing.rows_per_batch=16",
        "engine.max_slots=128", "checkpoint.save_every=1000"])
    summary = run_rl(cfg, progress=False)
    # The fixture starts at 33% greedy exact match on these 128 held-out problems.
    assert 0.2 <= summary["eval_before"] <= 0.6
    assert summary["eval_after"] >= summary["eval_before"] + 0.05, summary["history"][-1]
