"""Every built-in environment is selectable by name from the command line: `nonstop agentic
env.name=...` runs two training steps on it end to end in a subprocess, training on its train
split and evaluating on its held-out split."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nonstop.recipes.agentic_recipe import EnvSettings, make_env

REPO = Path(__file__).resolve().parents[2]

TINY = ["steps=2", "num_eval=2", "group_size=2", "groups_per_step=2", "max_concurrency=8",
        "engine.max_slots=8", "agent.max_tokens_per_turn=12", "agent.max_turns=2",
        "model.num_layers=1", "model.hidden_size=32", "model.head_dim=8",
        "checkpoint.save_every=100"]


@pytest.mark.parametrize("name, env_class", [
    ("calculator", "CalculatorEnv"), ("gridworld", "GridWorldEnv"), ("python", "PythonEnv"),
    ("retrieval", "RetrievalEnv"),
])
def test_each_name_builds_its_environment_with_disjoint_splits(name, env_class):
    env = make_env(EnvSettings(name=name))
    assert type(env).__name__ == env_class
    train = {env.sample_task(seed, "train").prompt for seed in range(200)}
    held_out = {env.sample_task(seed, "eval").prompt for seed in range(200)}
    assert train and held_out and not train & held_out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["python", "retrieval"])
def test_nonstop_agentic_trains_on_a_builtin_env_named_on_the_command_line(name, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "nonstop", "agentic", "--config", "agentic_calculator_tiny",
         f"run_dir={run_dir}", f"env.name={name}", *TINY],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert f"name: {name}" in (run_dir / "config.yaml").read_text()
