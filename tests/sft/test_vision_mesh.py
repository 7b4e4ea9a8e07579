"""`train_vision` on a device mesh: a (data=2, fsdp=2) mesh of forced CPU devices takes the same
LoRA SFT steps as one device, the state and the batch (rows and images) really are sharded, two
processes under `jax.distributed` (2 CPU devices each, gloo) take them too and export what one
device exports, and a mesh that does not fit fails with a clear error.

The tiny model, tokenizer and square-colour data are `tests/sft/test_vision_sft.py`'s. SGD, not
Adam: Adam's first steps are nearly sign(gradient), which turns float noise in near-zero
gradients into full-size updates, while SGD keeps one device's and the mesh's parameters as
close as their gradients are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from nonstop.cli.main import main
from nonstop.models import Tokenizer, load_pretrained, save_pretrained
from nonstop.models.image_processor import ImageProcessor
from nonstop.models.lora import LoRAConfig
from nonstop.models.multimodal import init_vlm
from nonstop.models.sharding import MeshShape, make_mesh
from nonstop.sft.vision_data import make_vision_batch
from nonstop.sft.vision_trainer import (
    VisionTrainConfig,
    VisionTrainResult,
    build_vision_model,
    export_vision_model,
    merge_vision_adapters,
    read_examples,
    setup_step,
    train_vision,
)
from nonstop.train.metrics import MetricsConfig, read_jsonl
from nonstop.train.optim import OptimizerConfig, build_optimizer
from nonstop.train.state import TrainState
from tests.sft.test_vision_sft import SEQ_LEN, _cfg
from tests.sft.test_vision_sft import setup as setup  # noqa: F401 (the module fixture)
from tests.train.test_multiprocess import free_port

MESH = MeshShape(data=2, fsdp=2)
STEPS = 4
# Measured: losses (about 6) 4.8e-7 apart, one float32 ulp; LoRA parameters 2.6e-7 apart, of
# lora_b entries up to 0.37.
LOSS_TOLERANCE = 2e-6
PARAM_TOLERANCE = 1e-6
REPO_ROOT = Path(__file__).parents[2]
WORKER_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def base(setup, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """A random checkpoint of the tiny VLM (embeddings scaled up, as in test_vision_sft, so the
    frozen tied head can express answers and the adapters get real gradients; by 5 rather than
    20, so the loss stays near log V and the steps stay smooth) and the train data."""
    directory, tokenizer, _, _, _, _ = setup
    model = init_vlm(_cfg(), seed=3)
    embed = model.language_model.embed
    embed.set_value(embed[...] * 5.0)
    path = tmp_path_factory.mktemp("vlm_base")
    save_pretrained(model, path)
    (path / "preprocessor_config.json").write_text(
        json.dumps(ImageProcessor(height=28, width=28).to_dict()))
    return path, directory / "train.jsonl", tokenizer, directory / "tok"


def _config(base, run_dir, **changes) -> VisionTrainConfig:
    path, data = base[:2]
    settings = dict(
        model_path=str(path), data_path=str(data), run_dir=str(run_dir), steps=STEPS,
        batch_size=4, seq_len=SEQ_LEN, max_images=4, vision_lora=True, export=False,
        lora=LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj")),
        optimizer=OptimizerConfig(name="sgd", learning_rate=0.1, b1=0.0, schedule="constant",
                                  max_grad_norm=None),
        metrics=MetricsConfig(progress_bar=False))
    return VisionTrainConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory) -> tuple[VisionTrainResult, VisionTrainResult]:
    runs_dir = tmp_path_factory.mktemp("vision_mesh")
    tokenizer = base[2]
    one = train_vision(_config(base, runs_dir / "one"), tokenizer=tokenizer)
    mesh = train_vision(_config(base, runs_dir / "mesh", mesh=MESH), tokenizer=tokenizer)
    return one, mesh


def _lora(model) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
    return {"/".join(map(str, path)): np.asarray(jax.device_get(var.get_value()))
            for path, var in flat}


def test_mesh_takes_the_same_steps_as_one_device(runs):
    one, mesh = runs
    assert len(one.losses) == len(mesh.losses) == STEPS
    print(f"loss diff {np.max(np.abs(np.subtract(one.losses, mesh.losses))):.2e}")
    np.testing.assert_allclose(mesh.losses, one.losses, rtol=0, atol=LOSS_TOLERANCE)
    assert one.losses[-1] < one.losses[0] - 0.5  # the steps really train
    for a, b in zip(one.metrics, mesh.metrics, strict=True):
        assert (a["tokens"], a["images"], a["loss_tokens"]) == (
            b["tokens"], b["images"], b["loss_tokens"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    single, sharded = _lora(one.model), _lora(mesh.model)
    assert single.keys() == sharded.keys()
    assert any("vision" in k for k in single) and any("language_model" in k for k in single)
    biggest = max(float(np.max(np.abs(v))) for k, v in single.items() if "lora_b" in k)
    diff = max(float(np.max(np.abs(single[k] - sharded[k]))) for k in single)
    print(f"lora param diff {diff:.2e} (largest lora_b {biggest:.2e})")
    assert biggest > 1e-2  # the adapters moved far more than the tolerance
    assert diff < PARAM_TOLERANCE


def test_state_is_sharded_over_the_mesh(runs):
    _, mesh = runs
    model = mesh.model
    cases = [  # (variable, logical axes' mesh spec on a (data=2, fsdp=2) mesh)
        (model.language_model.embed, (None, "fsdp")),  # vocab 389 -> tp (1), D 44 -> fsdp
        (model.vision.layers[0].attn.q_proj.base, ("fsdp", None, None)),  # Dv 22 -> fsdp
        (model.vision.layers[0].mlp.fc1, ("fsdp", None)),
        (model.language_model.layers[0].attn.q_proj.lora_a, ("fsdp", None)),  # D x rank
    ]
    for var, spec in cases:
        sharding = var.get_value().sharding
        assert not sharding.is_fully_replicated
        assert tuple(sharding.spec) == spec
        assert sharding.mesh.shape == {"data": 2, "fsdp": 2, "tp": 1}
        shard = var.get_value().addressable_shards[0].data.shape
        assert shard[list(spec).index("fsdp")] * 2 == var.get_value().shape[
            list(spec).index("fsdp")]


def test_batch_rows_and_images_are_split_over_the_mesh(base, tmp_path):
    cfg = _config(base, tmp_path, mesh=MESH)
    model = build_vision_model(cfg, base[2])
    examples = read_examples(cfg, model, base[2], ImageProcessor(height=28, width=28))
    state = TrainState.create(model, build_optimizer(cfg.optimizer), rng=jax.random.key(0),
                              wrt=nnx.LoRAParam)
    mesh = make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])
    placed = setup_step(cfg, state, mesh).put(
        make_vision_batch(examples[:4], seq_len=SEQ_LEN, max_images=4))
    for leaf in placed:  # tokens ... [4, T] and images [4, 28, 28, 3]: one row / image a device
        assert {s.data.shape[0] for s in leaf.addressable_shards} == {1}
        assert len({s.device for s in leaf.addressable_shards}) == 4
    np.testing.assert_array_equal(np.asarray(placed.images),
                                  np.concatenate([ex.images for ex in examples[:4]]))


def _expected_export(one: VisionTrainResult) -> dict:
    """The one-device run's weights with its adapters merged (on a copy)."""
    return dict(nnx.to_flat_state(nnx.state(merge_vision_adapters(nnx.clone(one.model)))))


def _check_export(directory, expected: dict, base_dir) -> None:
    exported = nnx.to_flat_state(nnx.state(load_pretrained(directory)))
    base_model = dict(nnx.to_flat_state(nnx.state(load_pretrained(base_dir))))
    moved, diff = 0, 0.0
    for path, var in exported:
        got, want = np.asarray(var.get_value()), np.asarray(expected[path].get_value())
        np.testing.assert_allclose(got, want, rtol=0, atol=PARAM_TOLERANCE, err_msg=str(path))
        moved += not np.array_equal(want, np.asarray(base_model[path].get_value()))
        diff = max(diff, float(np.max(np.abs(got - want))))
    print(f"exported weights diff {diff:.2e}")
    assert moved >= 3 * 2 + 2  # q, v, up in each LM layer and q, v in the vision layer


def test_export_from_the_mesh_equals_one_device(runs, base, tmp_path):
    """The merged export of the sharded state is the one-device model merged (in float32)."""
    one, mesh = runs
    cfg = _config(base, tmp_path / "export_run", mesh=MESH)
    directory = export_vision_model(cfg, mesh.model, base[2], ImageProcessor(height=28, width=28))
    _check_export(directory, _expected_export(one), base[0])


def test_two_processes_take_the_same_steps_and_export(runs, base, tmp_path):
    """`python -m tests.sft.test_vision_mesh` as two processes of 2 CPU devices each: the
    global (data=2, fsdp=2) mesh gives one device's losses and, exported by process 0 from the
    gathered weights, its merged model; process 1 logs to RUN_DIR/process_1."""
    one, _ = runs
    run_dir, port = tmp_path / "run", free_port()
    procs = []
    for i in range(2):
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
               "JAX_PLATFORMS": "cpu", "NONSTOP_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
               "NONSTOP_NUM_PROCESSES": "2", "NONSTOP_PROCESS_ID": str(i)}
        log = open(tmp_path / f"worker_{i}.log", "w")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "tests.sft.test_vision_mesh", str(base[0]), str(base[1]),
             str(base[3]), str(run_dir)], cwd=REPO_ROOT, env=env, stdout=log,
            stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=WORKER_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(f"timeout ({proc.wait()})")
        log.close()
    if codes != [0, 0]:
        logs = "".join((tmp_path / f"worker_{i}.log").read_text()[-3000:] for i in range(2))
        pytest.fail(f"workers exited with {codes}:\n{logs}")
    for metrics in (run_dir / "metrics.jsonl", run_dir / "process_1" / "metrics.jsonl"):
        losses = [r["loss"] for r in read_jsonl(metrics)]
        print(f"two-process loss diff {np.max(np.abs(np.subtract(losses, one.losses))):.2e}")
        np.testing.assert_allclose(losses, one.losses, rtol=0, atol=LOSS_TOLERANCE)
    assert not (run_dir / "process_1" / "export").exists()
    _check_export(run_dir / "export", _expected_export(one), base[0])


@pytest.mark.parametrize("changes, message", [
    (dict(batch_size=6), r"VisionTrainConfig.batch_size=6 is invalid; expected a multiple of "
                         r"mesh.data x mesh.fsdp = 2 x 2 = 4"),
    (dict(max_images=6), r"VisionTrainConfig.max_images=6 is invalid; expected a multiple of "
                         r"mesh.data x mesh.fsdp = 2 x 2 = 4"),
])
def test_rows_or_images_not_divisible_by_the_mesh_is_an_error(base, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        _config(base, tmp_path, mesh=MESH, **changes)


def test_mesh_larger_than_the_devices_is_an_error(base, tmp_path):
    cfg = _config(base, tmp_path, mesh=MeshShape(data=2, fsdp=8), batch_size=16,
                  max_images=16)
    with pytest.raises(ValueError, match=r"mesh data=2 x fsdp=8 x tp=1 needs 16 devices; 8 are "
                                         r"available"):
        train_vision(cfg, tokenizer=base[2])


def test_cli_mesh_keys_are_checked(capsys):
    code = main(["vlm", "model_path=/ckpt", "data_path=/data.jsonl", "mesh.fsdp=4",
                 "batch_size=6"])
    assert code == 2
    err = capsys.readouterr().err
    assert "batch_size=6 is invalid; expected a multiple of mesh.data x mesh.fsdp" in err


if __name__ == "__main__":  # one process of test_two_processes_take_the_same_steps_and_export
    model_path, data_path, tokenizer_path, run_dir = sys.argv[1:]
    worker_tokenizer = Tokenizer.from_pretrained(tokenizer_path)
    train_vision(_config((model_path, data_path), run_dir, mesh=MESH, export=True),
                 tokenizer=worker_tokenizer)
