"""Orbax checkpoints: round trip, retention, sharded restore, and a run killed with SIGKILL and
resumed that ends exactly where an uninterrupted run ends, without losing metrics.

This file is also the training worker of the SIGKILL test: `python -m tests.train.test_checkpoint
RUN_DIR [--kill-after STEP]` trains the tiny model on a seeded Grain pipeline, checkpointing every
3 steps, and resumes from RUN_DIR if it holds a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nonstop.train.checkpoint import CheckpointConfig, Checkpointer
from nonstop.train.metrics import MetricsConfig, MetricsWriter, read_jsonl
from nonstop.train.optim import OptimizerConfig, build_optimizer, build_schedule
from nonstop.train.state import TrainState, state_shardings
from nonstop.train.step import make_train_step
from tests.train.test_step import B, T, TinyLM, V, lm_loss

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL_STEPS, SAVE_EVERY = 10, 3
OPT = OptimizerConfig(learning_rate=3e-2, warmup_steps=2, total_steps=TOTAL_STEPS)


def synthetic_dataset() -> grain.IterDataset:
    """Seeded, shuffled, resumable: the iterator's get_state() is {'next_index': n}."""

    def example(i: int) -> dict[str, np.ndarray]:
        rs = np.random.RandomState(i)
        tokens = rs.randint(0, V, size=T).astype(np.int32)
        return {
            "tokens": tokens,
            "targets": np.roll(tokens, -1),
            "loss_mask": np.arange(T) < rs.randint(1, T + 1),
        }

    ds = grain.MapDataset.range(29).shuffle(seed=7).map(example)
    return ds.batch(B, drop_remainder=True).repeat(None).to_iter_dataset()


def train(run_dir: str, *, kill_after: int | None = None) -> tuple[dict, int]:
    """Train to TOTAL_STEPS (resuming if possible); returns (final params, start step)."""
    optimizer = build_optimizer(OPT)
    state = TrainState.create(TinyLM(), optimizer, rng=jax.random.key(0))
    data = iter(synthetic_dataset())
    checkpointer = Checkpointer(
        CheckpointConfig(
            directory=os.path.join(run_dir, "checkpoints"), save_every=SAVE_EVERY, keep_last=2
        )
    )
    restored = checkpointer.restore(state)
    start = 0
    if restored is not None:
        state, start = restored.state, restored.step
        data.set_state(restored.data_state)
    step_fn = make_train_step(lm_loss, optimizer, learning_rate=build_schedule(OPT))
    writer = MetricsWriter(
        run_dir,
        MetricsConfig(tensorboard=False, progress_bar=False),
        resume_step=start if restored is not None else None,
    )
    for step in range(start + 1, TOTAL_STEPS + 1):
        state, metrics = step_fn(state, next(data))
        writer.write(step, metrics)
        if checkpointer.should_save(step):
            writer.flush()  # every metric up to a checkpoint is on disk before it is saved
            checkpointer.save(step, state, data_state=data.get_state(), metadata={"run": "t"})
        if step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    writer.close()
    checkpointer.save(TOTAL_STEPS, state, data_state=data.get_state(), force=True)
    checkpointer.close()
    return jax.tree.map(np.asarray, nnx.to_pure_dict(state.params)), start


def _run_worker(run_dir: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.train.test_checkpoint", run_dir, *extra],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_sigkilled_run_resumes_to_the_uninterrupted_result(tmp_path):
    reference, _ = train(str(tmp_path / "reference"))
    run_dir = str(tmp_path / "killed")

    # Killed right after starting the asynchronous save of step 6.
    killed = _run_worker(run_dir, "--kill-after", "6")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    lines_at_kill = open(os.path.join(run_dir, "metrics.jsonl")).readlines()
    assert [r["step"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))] == list(
        range(1, 7)
    )
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    complete = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
    assert complete and complete[-1] in (3, 6), os.listdir(ckpt_dir)
    # Usually the kill lands mid-write: step 6 is only a tmp dir, invisible as a checkpoint.
    interrupted = [d for d in os.listdir(ckpt_dir) if not d.isdigit()]
    assert not interrupted or complete[-1] == 3, os.listdir(ckpt_dir)

    # The resumed run goes on in this process (saving a second interpreter start-up).
    final, start = train(run_dir)
    assert start == complete[-1]  # resumed from the last complete checkpoint

    assert sorted(os.listdir(ckpt_dir)) == ["10", "9"]  # keep_last=2, tmp dirs cleaned up
    for name in reference:
        np.testing.assert_allclose(final[name], reference[name], atol=1e-6, rtol=0)

    # Every line written up to the restored checkpoint survives byte for byte, and the whole
    # history matches the uninterrupted run's step for step.
    lines_after = open(os.path.join(run_dir, "metrics.jsonl")).readlines()
    assert lines_after[:start] == lines_at_kill[:start]
    ref_records = read_jsonl(tmp_path / "reference" / "metrics.jsonl")
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, TOTAL_STEPS + 1))
    for got, want in zip(records, ref_records, strict=True):
        for name in ("loss", "grad_norm", "learning_rate", "tokens"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7)


@pytest.fixture
def state() -> TrainState:
    return TrainState.create(TinyLM(), build_optimizer(OPT), rng=jax.random.key(3))


def perturbed(state: TrainState, by: float) -> TrainState:
    return state.replace(
        params=jax.tree.map(lambda x: x + by, state.params),
        opt_state=jax.tree.map(lambda x: x + 1, state.opt_state),
        step=state.step + 5,
        rng=jax.random.split(state.rng)[0],
    )


def test_round_trip_retention_and_no_checkpoint(tmp_path, state):
    cfg = CheckpointConfig(directory=str(tmp_path), save_every=2, keep_last=2)
    with Checkpointer(cfg) as ckpt:
        assert ckpt.restore(state) is None
        assert not ckpt.save(1, state)  # not due
        saved = {}
        for step in (2, 4, 6):
            saved[step] = perturbed(state, by=0.5 * step)
            assert ckpt.save(
                step, saved[step], data_state={"next_index": step}, metadata={"version": step}
            )
        ckpt.wait()
        assert ckpt.all_steps() == [4, 6]
        restored = ckpt.restore(state)
        older = ckpt.restore(state, step=4)

    assert restored.step == 6 and restored.data_state == {"next_index": 6}
    assert restored.metadata == {"version": 6} and older.data_state == {"next_index": 4}
    for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(saved[6]), strict=True):
        if jnp.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(older.state.params["embed"][...], saved[4].params["embed"][...])
    assert restored.state.graphdef == state.graphdef


def test_restore_keeps_the_target_shardings(tmp_path, state):
    if len(jax.devices()) < 8:
        pytest.skip(
            "needs 8 devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8 "
            "before jax initialises (tests/conftest.py does)"
        )
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 2, 4), ("data", "fsdp", "tp"))
    shardings = state_shardings(state, mesh)
    sharded = jax.device_put(perturbed(state, by=1.0), shardings)
    with Checkpointer(CheckpointConfig(directory=str(tmp_path), save_every=1)) as ckpt:
        ckpt.save(1, sharded)
        ckpt.wait()
        restored = ckpt.restore(jax.device_put(state, shardings)).state
    for got, want in zip(
        jax.tree.leaves(restored.params), jax.tree.leaves(sharded.params), strict=True
    ):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert restored.opt_state[1][0].mu["mlp_in"][...].sharding.spec == PartitionSpec("fsdp", "tp")
    assert isinstance(restored.params["mlp_in"][...].sharding, NamedSharding)


@pytest.mark.parametrize("field, value", [("save_every", 0), ("keep_last", 0), ("directory", "")])
def test_config_rejects_bad_values(field, value):
    kwargs = {"directory": "/tmp/x", field: value}
    with pytest.raises(ValueError, match=field):
        CheckpointConfig(**kwargs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--kill-after", type=int, default=None)
    args = parser.parse_args()
    train(args.run_dir, kill_after=args.kill_after)
