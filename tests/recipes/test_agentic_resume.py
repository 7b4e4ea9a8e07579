"""`nonstop agentic` survives a crash: SIGKILLed mid-run, the same command resumes from the
latest checkpoint. At max_staleness 0 the final parameters equal an uninterrupted run's; at
max_staleness 1 (PPO with LoRA) no group is trained twice or lost. SIGTERM writes a checkpoint
and stops cleanly (exit 143). Subprocesses on a tiny SFT-warmed calculator agent."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from nonstop.models.source import ModelSource
from nonstop.recipes.config_io import dump_config, load_config
from nonstop.recipes.demo import DemoConfig
from nonstop.train import CheckpointConfig, MetricsConfig

FIXTURE = Path(__file__).parent.parent / "fixtures" / "calculator_sft"
STEPS, GROUPS = 5, 2
pytestmark = pytest.mark.slow


def write_config(path: Path, run_dir: Path, **changes) -> Path:
    cfg = DemoConfig(run_dir=str(run_dir), progress=False).agentic()
    settings = dict(
        run_dir=str(run_dir), model=ModelSource(path=str(FIXTURE)), steps=STEPS, num_eval=4,
        group_size=4, groups_per_step=GROUPS, max_concurrency=16, max_staleness=0,
        agent=dataclasses.replace(cfg.agent, step_timeout_s=None, max_turns=2),
        checkpoint=CheckpointConfig(save_every=1, keep_last=2),
        metrics=MetricsConfig(tensorboard=False))
    cfg = dataclasses.replace(cfg, **(settings | changes))
    path.write_text(yaml.safe_dump(dump_config(cfg), sort_keys=False))
    load_config(type(cfg), path)  # the file loads back
    return path


def command(config: Path) -> list[str]:
    return [sys.executable, "-m", "nonstop", "agentic", "--config", str(config)]


def run_to_end(config: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(command(config), capture_output=True, text=True, timeout=900,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def start_and_stop(config: Path, run_dir: Path, after_step: int, sig: int) -> int:
    """Start the run, send `sig` once the checkpoint of `after_step` is complete; exit code."""
    proc = subprocess.Popen(command(config), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 900
        while not (run_dir / "checkpoints" / str(after_step) / "_CHECKPOINT_METADATA").exists():
            assert proc.poll() is None, f"the run ended before step {after_step}: " \
                                        f"{proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
        proc.stderr_text = err
        return proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()


def final_params(run_dir: Path) -> dict[str, np.ndarray]:
    return load_file(run_dir / "final_model" / "model.safetensors")


def trained_groups(run_dir: Path) -> list[list[int]]:
    lines = (run_dir / "groups.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["groups"] for r in records]


def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path):
    whole = tmp_path / "whole"
    run_to_end(write_config(tmp_path / "whole.yaml", whole))
    crashed = tmp_path / "crashed"
    config = write_config(tmp_path / "crashed.yaml", crashed)
    assert start_and_stop(config, crashed, after_step=2, sig=signal.SIGKILL) == -signal.SIGKILL
    assert not (crashed / "final_model").exists()
    run_to_end(config)  # the same command resumes
    a, b = final_params(whole), final_params(crashed)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-6, rtol=0, err_msg=name)
    # The metrics are one history: each step once, equal to the uninterrupted run's.
    rows = [json.loads(x) for x in (crashed / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for got, want in zip(rows, ref, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
        assert got["reward_mean"] == want["reward_mean"]
    assert trained_groups(crashed) == trained_groups(whole)
    # The resumed run reports the first run's starting evaluation.
    assert rows[-1]["eval/solve_rate"] == ref[-1]["eval/solve_rate"]


def test_staleness_1_ppo_lora_loses_no_group_and_trains_none_twice(tmp_path):
    from nonstop.models.lora import LoRAConfig

    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", run_dir, algorithm="ppo", kl_coef=None,
                          max_staleness=1, lora=LoRAConfig(rank=4, alpha=8.0))
    assert start_and_stop(config, run_dir, after_step=2, sig=signal.SIGKILL) == -signal.SIGKILL
    killed_at = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    run_to_end(config)
    groups = trained_groups(run_dir)
    flat = [g for step in groups for g in step]
    assert len(flat) == len(set(flat)) == STEPS * GROUPS  # none twice
    # None lost: every group admitted early enough to be due was trained, across the crash.
    assert set(range((STEPS - 2) * GROUPS)) <= set(flat), (killed_at, groups)
    assert (run_dir / "final_model" / "model.safetensors").exists()


def test_sigterm_writes_a_checkpoint_and_stops_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", run_dir,
                          checkpoint=CheckpointConfig(save_every=100, keep_last=2))
    proc = subprocess.Popen(command(config), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 900
        while not (run_dir / "metrics.jsonl").exists() or \
                not (run_dir / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM after step" in err and "Run the same command again" in err
    saved = [int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert saved and max(saved) < STEPS  # written on SIGTERM (save_every=100 never came due)
    done = run_to_end(config)
    assert "solve rate" in done.stdout
    assert len(trained_groups(run_dir)) == STEPS
