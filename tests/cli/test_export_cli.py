"""`nonstop export` on a real two-step SFT LoRA run: merged, and as PEFT adapters that peft loads
onto the exported base with the logits of the run's own merged export."""

from __future__ import annotations

import argparse
import os
import shutil

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
import yaml

from nonstop.cli import export
from nonstop.cli.main import main
from nonstop.models import load_adapters, load_pretrained
from tests.models.hf_fixtures import hf_logits

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "nonstop", "recipes", "configs")
TINY = ["model.hidden_size=44", "model.intermediate_size=53", "model.head_dim=8",
        "metrics.progress_bar=false", "metrics.tensorboard=false", "optimizer.warmup_steps=0",
        "steps=2", "checkpoint.save_every=100", "builtin_data.num_train=40",
        "builtin_data.num_eval=8", "lora.rank=4", "lora.alpha=8.0",
        "lora.targets=[q_proj,v_proj,o_proj,down_proj]", "optimizer.learning_rate=0.05"]


def nonstop_export(*argv: str) -> int:
    """`nonstop export ARGV` through the module's own parser (as cli/main.py registers it)."""
    parser = argparse.ArgumentParser(prog="nonstop")
    export.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["export", *argv])
    return args.run(args)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sft_lora")
    assert main(["sft", "--config", os.path.join(CONFIGS, "sft_tiny.yaml"),
                 f"run_dir={directory}", *TINY]) == 0
    return directory


@pytest.fixture(scope="module")
def tokens(run_dir):
    vocab = load_pretrained(run_dir / "export").cfg.vocab_size
    return np.random.RandomState(0).randint(3, vocab, (2, 9)).astype(np.int32)


def _logits(model, tokens) -> np.ndarray:
    return np.asarray(model(jnp.asarray(tokens))[0])


def test_merged_export_equals_the_runs_own(run_dir, tmp_path, tokens, capsys):
    assert nonstop_export(str(run_dir), "--out", str(tmp_path / "merged")) == 0
    assert "step 2 merged into a Hugging Face checkpoint" in capsys.readouterr().out
    assert (tmp_path / "merged" / "tokenizer.json").exists()
    np.testing.assert_allclose(_logits(load_pretrained(tmp_path / "merged"), tokens),
                               _logits(load_pretrained(run_dir / "export"), tokens),
                               atol=1e-6, rtol=0)


def test_adapters_load_in_peft_onto_the_exported_base(run_dir, tmp_path, tokens):
    out = tmp_path / "adapters"
    assert nonstop_export(str(run_dir), "--adapters", "--out", str(out)) == 0
    # A tiny random-init base exists nowhere else, so it is written with the adapters.
    assert (out / "base" / "config.json").exists() and (out / "base" / "tokenizer.json").exists()
    config = yaml.safe_load((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["base_model_name_or_path"] == str((out / "base").resolve())

    expected = _logits(load_pretrained(run_dir / "export"), tokens)  # the run's merged model
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    base_logits = hf_logits(base.eval(), tokens)
    assert np.abs(base_logits - expected).max() > 1e-3  # two steps moved the adapters
    adapted = peft.PeftModel.from_pretrained(base, out).eval()
    np.testing.assert_allclose(hf_logits(adapted, tokens), expected, atol=1e-4, rtol=0)

    ours = load_adapters(load_pretrained(out / "base"), out)
    np.testing.assert_allclose(_logits(ours, tokens), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["no_dir", "no_config", "no_checkpoint", "full_weights",
                                  "with_base_alone"])
def test_errors_are_one_line_with_status_2(run_dir, tmp_path, capsys, case):
    target = tmp_path / "run"
    flags: list[str] = []
    if case in ("no_config", "no_checkpoint", "full_weights"):
        target.mkdir()
    if case in ("no_checkpoint", "full_weights"):
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        if case == "full_weights":
            config["lora"] = None
            shutil.copytree(run_dir / "checkpoints", target / "checkpoints")
            flags = ["--adapters"]  # refused from the config, before restoring anything
        (target / "config.yaml").write_text(yaml.safe_dump(config))
    if case == "with_base_alone":
        target, flags = run_dir, ["--with-base"]
    assert nonstop_export(str(target), *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("nonstop export: error: ") and err.count("\n") == 1, err
    assert {
        "no_dir": "no such run directory",
        "no_config": "config.yaml: not found",
        "no_checkpoint": "no checkpoint",
        "full_weights": "the run trained full weights",
        "with_base_alone": "--with-base goes with --adapters",
    }[case] in err
