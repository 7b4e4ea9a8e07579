"""`nonstop vlm` survives a crash: SIGKILLed after a checkpoint, the same command resumes and ends
with the parameters of a run never stopped (1e-6) having trained on exactly the same examples,
step for step (none lost, none twice); SIGTERM checkpoints the current step and exits 143, and
`--resume RUN_DIR` finishes the run. Subprocesses on the tiny Gemma 3 VLM of
tests/cli/test_vlm_cli.py; they share the suite's persistent JAX compilation cache, so only the
first run compiles the step (a few seconds of loading in the others)."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from nonstop.train.metrics import read_jsonl
from tests.cli.test_vlm_cli import CONFIG, TINY, write_squares, write_tiny_vlm

STEPS, BATCH, EXAMPLES = 12, 2, 5  # 24 draws of 5 examples: epochs end mid-batch
SETTINGS = [
    *TINY,
    f"steps={STEPS}",
    f"batch_size={BATCH}",
    "metrics.tensorboard=false",
    "checkpoint.save_every=3",
    "checkpoint.keep_last=2",
    "lora.dropout=0.1",
]
DEADLINE_S = 300


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_vlm(tmp_path_factory.mktemp("tiny_gemma3_vlm"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_squares(tmp_path_factory.mktemp("squares"), EXAMPLES)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    # The suite's compilation cache (tests/conftest.py) lets every run after the first load the
    # step. The cheaper LLVM passes cut the one compile by a third; every run here uses them.
    fast = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    return os.environ | {
        "PYTHONUNBUFFERED": "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {fast}".strip(),
    }


def command(checkpoint: Path, data: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "nonstop",
        "vlm",
        "--config",
        str(CONFIG),
        f"model_path={checkpoint}",
        f"data_path={data}",
        f"run_dir={run_dir}",
        *SETTINGS,
        *overrides,
    ]


def run_to_end(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=DEADLINE_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def saved_steps(run_dir: Path) -> list[int]:
    """The checkpoints Orbax finished writing (an interrupted one has no metadata file)."""
    directory = run_dir / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(
        int(p.name)
        for p in directory.iterdir()
        if p.name.isdigit() and (p / "_CHECKPOINT_METADATA").exists()
    )


def trained_lines(run_dir: Path) -> list[list[int]]:
    """The data lines of each step's batch, from RUN_DIR/examples.jsonl (one record a step)."""
    records = read_jsonl(run_dir / "examples.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["lines"] for r in records]


def stop_when(proc: subprocess.Popen, ready, sig: int) -> str:
    """Send `sig` once `ready()` holds; the run's stderr once it has exited."""
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ready():
            assert proc.poll() is None, f"the run ended first: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "timed out waiting for the run"
            time.sleep(0.02)
        proc.send_signal(sig)
        return proc.communicate(timeout=DEADLINE_S)[1]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigkill_then_resume_equals_an_uninterrupted_run(checkpoint, data, env, tmp_path):
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    run_to_end(command(checkpoint, data, whole), env)
    argv = command(checkpoint, data, crashed)
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    stop_when(proc, lambda: bool(saved_steps(crashed)), signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    killed_at = saved_steps(crashed)[-1]
    assert killed_at < STEPS and not (crashed / "export").exists()
    done = run_to_end(argv, env)  # the same command resumes
    assert f"resumed after step {killed_at}" in done.stdout, done.stdout

    a = load_file(whole / "export" / "model.safetensors")
    b = load_file(crashed / "export" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], atol=1e-6, rtol=0, err_msg=name)
    # The same examples, step for step, each drawn once per epoch: none lost or repeated.
    lines = trained_lines(crashed)
    assert lines == trained_lines(whole)
    counts = collections.Counter(line for batch in lines for line in batch)
    assert sorted(counts) == list(range(1, EXAMPLES + 1))
    assert set(counts.values()) <= {STEPS * BATCH // EXAMPLES, STEPS * BATCH // EXAMPLES + 1}
    # metrics.jsonl is one history: each step once, the losses of the uninterrupted run.
    got, want = read_jsonl(crashed / "metrics.jsonl"), read_jsonl(whole / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], atol=1e-6)


def test_sigterm_checkpoints_the_current_step_and_resume_finishes(checkpoint, data, env, tmp_path):
    run_dir = tmp_path / "run"
    argv = command(checkpoint, data, run_dir, "checkpoint.save_every=1000")
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    log = run_dir / "examples.jsonl"
    err = stop_when(proc, lambda: log.exists() and len(read_jsonl(log)) >= 1, signal.SIGTERM)
    assert proc.returncode == 143, err[-3000:]
    stopped_at = read_jsonl(log)[-1]["step"]
    assert f"stopped by SIGTERM after step {stopped_at} of {STEPS}" in err, err[-3000:]
    assert "Run the same command again to resume" in err
    # save_every=1000 never came due: the one checkpoint is SIGTERM's, at the step it ended.
    assert saved_steps(run_dir) == [stopped_at] and stopped_at < STEPS
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(
        range(1, stopped_at + 1)
    )
    assert not (run_dir / "export").exists()
    done = run_to_end([sys.executable, "-m", "nonstop", "vlm", "--resume", str(run_dir)], env)
    assert f"resumed after step {stopped_at}" in done.stdout, done.stdout
    assert (run_dir / "export" / "model.safetensors").exists()
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
    trained_lines(run_dir)  # each step once


@pytest.mark.parametrize("num_examples, batch_size", [(5, 2), (6, 3), (3, 4), (7, 7)])
def test_example_order_skip_lands_where_the_takes_left_off(num_examples, batch_size):
    from nonstop.sft.vision_trainer import ExampleOrder

    steps = 11
    whole = ExampleOrder(num_examples, seed=3)
    drawn = [whole.take(batch_size) for _ in range(steps)]
    for stop in range(steps):
        resumed = ExampleOrder(num_examples, seed=3)
        resumed.skip(sum(len(batch) for batch in drawn[:stop]))
        assert [resumed.take(batch_size) for _ in range(stop, steps)] == drawn[stop:]
    # Epoch by epoch: every full epoch's draws hold each example once.
    flat = [i for batch in drawn for i in batch]
    for epoch in range(len(flat) // num_examples):
        assert sorted(flat[epoch * num_examples : (epoch + 1) * num_examples]) == list(
            range(num_examples)
        )
