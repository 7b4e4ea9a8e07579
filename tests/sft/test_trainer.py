"""The supervised trainer: sharded step parity, the DPO reference under LoRA and full fine-tuning,
ORPO's two terms, LoRA/QLoRA runs that train and save only adapters and export merged weights,
and a run killed with SIGKILL that resumes to exactly the uninterrupted result.

This file is also the worker of the SIGKILL test: `python -m tests.sft.test_trainer RUN_DIR
--kill-after STEP [key=value ...]` loads tests' SFT config the way the CLI does and SIGKILLs
itself after STEP.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from nonstop.cli.sft import load_run_config
from nonstop.cli.sft import main as cli_main
from nonstop.models.checkpoint import load_pretrained
from nonstop.models.lora import LoRAConfig, apply_lora
from nonstop.recipes.sft_data import prepare_run
from nonstop.sft.losses import DPOConfig, ORPOConfig, orpo_loss, preference_pairs
from nonstop.sft.losses import sequence_logprobs as seq_logprobs
from nonstop.sft.preference import (
    PolicyWithReference,
    dpo_loss_fn,
    forward_logprobs,
    orpo_loss_fn,
    reference_of,
    zeroed_adapters,
)
from nonstop.sft.reference import training_dataset
from nonstop.sft.trainer import build_mesh, build_train_model, create_state, setup_step, train
from nonstop.train.checkpoint import CheckpointConfig, Checkpointer
from nonstop.train.metrics import read_jsonl

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO_ROOT, "nonstop", "recipes", "configs", "sft_tiny.yaml")
TINY = ["model.hidden_size=44", "model.intermediate_size=52", "model.num_heads=4",
        "model.num_kv_heads=2", "model.head_dim=8", "builtin_data.num_train=200",
        "builtin_data.num_eval=8", "metrics.progress_bar=false", "metrics.tensorboard=false"]
KILL_RUN = [*TINY, "steps=8", "optimizer.warmup_steps=2", "checkpoint.save_every=3",
            "checkpoint.keep_last=2"]


def tiny_config(algorithm: str, run_dir, *extra: str):
    path = CONFIG.replace("sft_tiny", f"{algorithm}_tiny")
    return prepare_run(load_run_config(algorithm, path, [f"run_dir={run_dir}", *TINY, *extra]))


def first_batch(cfg, tokenizer):
    return next(iter(training_dataset(cfg.data_config(), tokenizer))).batch


def assert_trees_close(got, want, atol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------- sharding


def test_sharded_step_fsdp2_tp4_equals_unsharded(tmp_path):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 CPU devices)")
    cfg, tokenizer = tiny_config("sft", tmp_path, "grad_accum_steps=2")
    sharded_cfg, _ = tiny_config("sft", tmp_path, "grad_accum_steps=2", "mesh.fsdp=2",
                                 "mesh.tp=4")
    batch = first_batch(cfg, tokenizer)
    plain = setup_step(cfg, create_state(cfg, build_train_model(cfg, tokenizer)), None)
    mesh = build_mesh(sharded_cfg)
    sharded = setup_step(sharded_cfg, create_state(sharded_cfg, build_train_model(cfg, tokenizer)), mesh)

    state, sharded_state = plain.state, sharded.state
    for _ in range(2):
        state, metrics = plain.step(state, plain.put(batch))
        sharded_state, sharded_metrics = sharded.step(sharded_state, sharded.put(batch))
    assert_trees_close(sharded_state.params, state.params, atol=1e-5)
    np.testing.assert_allclose(sharded_metrics["loss"], metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(sharded_metrics["grad_norm"], metrics["grad_norm"], rtol=1e-4)
    up = sharded_state.params["layers"][0]["mlp"]["up_proj"][...]  # [D=44, F=52]
    assert up.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tp")
    assert len({s.device for s in up.addressable_shards}) == 8


# ------------------------------------------------------------------------ DPO reference, ORPO


@pytest.fixture(scope="module")
def preference_setup(tmp_path_factory):
    cfg, tokenizer = tiny_config("dpo", tmp_path_factory.mktemp("dpo"))
    return cfg, tokenizer, first_batch(cfg, tokenizer)


def test_lora_reference_is_the_base_and_precomputed_equals_on_the_fly(preference_setup):
    cfg, tokenizer, batch = preference_setup
    base = build_train_model(cfg, tokenizer)
    base_logprobs = forward_logprobs(base, batch)
    model = apply_lora(nnx.clone(base), LoRAConfig(rank=3, targets=("q_proj", "v_proj")))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        if path[-1] == "lora_b":  # non-zero adapters: the policy now differs from the base
            var.set_value(0.5 * jax.random.normal(jax.random.key(len(path)), var.shape))
    assert not np.allclose(forward_logprobs(model, batch), base_logprobs, atol=1e-3)
    np.testing.assert_allclose(forward_logprobs(zeroed_adapters(model), batch), base_logprobs,
                               atol=1e-6)

    segments = cfg.packing.max_segments_per_row
    rng = jax.random.key(0)
    with_ref = batch.__class__(**{**batch.__dict__, "ref_logprobs": np.asarray(base_logprobs)})
    for loss_type in ("sigmoid", "ipo", "hinge"):
        dpo = DPOConfig(loss_type=loss_type, beta=0.3)
        precomputed = dpo_loss_fn(dpo, reference="precomputed", num_segments=segments)
        on_the_fly = dpo_loss_fn(dpo, reference="on_the_fly", num_segments=segments)
        num_a, den_a, aux_a = precomputed(model, with_ref, rng)
        num_b, den_b, aux_b = on_the_fly(model, batch, rng)
        np.testing.assert_allclose(num_a, num_b, rtol=1e-5)
        assert float(den_a) == float(den_b) > 0
        np.testing.assert_allclose(aux_a["margins"], aux_b["margins"], rtol=1e-4, atol=1e-6)
    # Reference-free: the rewards are beta * log pi alone.
    free = dpo_loss_fn(DPOConfig(reference_free=True, beta=0.5), reference="precomputed",
                       num_segments=segments)
    _, _, aux = free(model, batch, rng)
    np.testing.assert_allclose(aux["rewards_chosen"], 0.5 * aux["logps_chosen"], rtol=1e-6)


def test_full_finetuning_reference_is_a_frozen_copy(preference_setup, tmp_path):
    cfg, tokenizer, batch = preference_setup
    on_the_fly, _ = tiny_config("dpo", tmp_path, "reference=on_the_fly")
    model = build_train_model(on_the_fly, tokenizer)
    assert isinstance(model, PolicyWithReference)
    state = create_state(on_the_fly, model)
    trained_paths = {path[0] for path, _ in nnx.to_flat_state(state.params)}
    assert trained_paths == {"policy"}
    model.policy.embed.set_value(model.policy.embed[...] + 1.0)  # training moves the policy only
    np.testing.assert_allclose(forward_logprobs(reference_of(model), batch),
                               forward_logprobs(build_train_model(cfg, tokenizer), batch), atol=1e-6)


def test_orpo_loss_fn_is_nll_plus_lambda_odds_ratio(preference_setup):
    cfg, tokenizer, batch = preference_setup
    model = build_train_model(cfg, tokenizer)
    num, den, aux = orpo_loss_fn(ORPOConfig(lam=0.7), num_segments=8)(model, batch,
                                                                       jax.random.key(0))
    pairs = preference_pairs(seq_logprobs(forward_logprobs(model, batch), batch.loss_mask,
                                          batch.segment_ids, 8))
    terms, _ = orpo_loss(pairs)
    np.testing.assert_allclose(num / den, terms.total(0.7), rtol=1e-6)
    chosen_targets = sum(float(pairs.chosen_count[i]) for i in np.flatnonzero(pairs.mask))
    assert float(den) == chosen_targets
    np.testing.assert_allclose(aux["nll"], -jnp.sum(pairs.chosen * pairs.mask) / den, rtol=1e-6)


# ---------------------------------------------------------------------------- LoRA / QLoRA


def test_qlora_run_trains_and_saves_only_adapters_and_exports_merged(tmp_path):
    cfg, tokenizer = tiny_config(
        "sft", tmp_path, "steps=2", "lora.rank=4", "lora.targets=[q_proj, up_proj]",
        "quantization.kind=int8", "checkpoint.save_every=1", "metrics.tensorboard=true",
        "optimizer.warmup_steps=0", "optimizer.learning_rate=0.01")
    result = train(cfg, tokenizer=tokenizer)
    assert result.last_step == 2

    params = nnx.to_flat_state(result.state.params)
    assert params and all(isinstance(v, nnx.LoRAParam) for _, v in params)
    assert {path[-1] for path, _ in params} == {"lora_a", "lora_b"}
    assert any(np.abs(v[...]).max() > 0 for p, v in params if p[-1] == "lora_b")  # it trained
    with Checkpointer(CheckpointConfig(directory=str(tmp_path / "checkpoints"))) as ckpt:
        assert ckpt.all_steps() == [1, 2]
        restored = ckpt.restore(create_state(cfg, build_train_model(cfg, tokenizer)))
    assert_trees_close(restored.state.params, result.state.params, atol=0)

    exported = load_pretrained(result.export_dir)
    tokens = np.array([tokenizer.encode("abcdefg")], np.int32)
    want, _ = result.state.model()(tokens)
    got, _ = exported(tokens)
    np.testing.assert_allclose(got, want, atol=1e-4)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for name in ("loss", "learning_rate", "grad_norm", "tokens", "tokens_per_second"):
        assert name in records[-1]
    assert os.listdir(tmp_path / "tensorboard")


# ---------------------------------------------------------------------------- kill and resume


def _export_weights(run_dir) -> dict[str, np.ndarray]:
    return load_file(os.path.join(run_dir, "export", "model.safetensors"))


@pytest.mark.slow
def test_sigkilled_cli_run_resumes_to_the_uninterrupted_result(tmp_path):
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    assert cli_main(["sft", "--config", CONFIG, f"run_dir={reference_dir}", *KILL_RUN]) == 0

    killed = subprocess.run(
        [sys.executable, "-m", "tests.sft.test_trainer", str(run_dir), "--kill-after", "7"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    lines_at_kill = open(run_dir / "metrics.jsonl").readlines()
    # Metrics are written one step behind (and flushed at each checkpoint): step 7's was pending.
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 7))
    complete = sorted(int(d) for d in os.listdir(run_dir / "checkpoints") if d.isdigit())
    assert complete and complete[-1] in (3, 6), os.listdir(run_dir / "checkpoints")

    # Resumed by running the same command again.
    assert cli_main(["sft", "--config", CONFIG, f"run_dir={run_dir}", *KILL_RUN]) == 0
    restored_step = complete[-1]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["6", "8"]  # keep_last=2, tmp cleaned
    want, got = _export_weights(reference_dir), _export_weights(run_dir)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-6, rtol=0)

    lines_after = open(run_dir / "metrics.jsonl").readlines()
    assert lines_after[:restored_step] == lines_at_kill[:restored_step]
    records = read_jsonl(run_dir / "metrics.jsonl")
    reference = read_jsonl(reference_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    for got_record, want_record in zip(records, reference, strict=True):
        for name in ("loss", "grad_norm", "learning_rate", "tokens"):
            np.testing.assert_allclose(got_record[name], want_record[name], rtol=1e-6)


def _kill_worker(run_dir: str, kill_after: int, overrides: list[str]) -> None:
    cfg, tokenizer = prepare_run(load_run_config("sft", CONFIG, [f"run_dir={run_dir}",
                                                                 *KILL_RUN, *overrides]))

    def on_step(step: int) -> None:
        if step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    train(cfg, tokenizer=tokenizer, on_step=on_step)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--kill-after", type=int, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    _kill_worker(args.run_dir, args.kill_after, args.overrides)
