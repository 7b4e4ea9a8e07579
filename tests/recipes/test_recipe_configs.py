"""Every shipped recipe config loads and validates, and those for real checkpoints build their
model and tokenizer from a tiny stand-in checkpoint in the expected layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nonstop.agentic.config import AgentConfig
from nonstop.cli.main import main
from nonstop.cli.sft import load_run_config
from nonstop.models import ModelConfig, init_decoder, save_pretrained
from nonstop.models.source import build_model, build_tokenizer
from nonstop.recipes.agentic_recipe import AgenticRunConfig
from nonstop.recipes.config_io import load_config
from nonstop.recipes.rl_recipe import RLRunConfig
from nonstop.sft.config import SFTRunConfig
from nonstop.sft.trainer import build_train_model as build_sft_model
from nonstop.sft.trainer import load_tokenizer
from nonstop.sft.vision_trainer import VisionTrainConfig
from tests.models.tokenizer_fixtures import build_tiny_tokenizer

CONFIGS = Path("nonstop/recipes/configs")
FAMILY = {"qwen3_0_6b": ("qwen3", "qwen"), "llama3_2_1b": ("llama", "llama3"),
          "gemma3_1b": ("gemma3", "gemma")}


def _kind(path: Path):
    name = path.name
    if name.startswith("agentic"):
        return AgenticRunConfig
    if name.startswith("vlm_"):
        return VisionTrainConfig  # run end to end on a stand-in by tests/cli/test_vlm_cli.py
    if any(name.startswith(p) for p in ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "ppo")):
        return RLRunConfig
    return SFTRunConfig


def _load(path: Path, overrides=()):
    cls = _kind(path)
    if cls is SFTRunConfig:
        algorithm = next((a for a in ("dpo", "orpo") if path.name.startswith(a)), "sft")
        return load_run_config(algorithm, str(path), list(overrides))
    return load_config(cls, path, overrides)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_config_loads(path):
    _load(path)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    out = {}
    for key, (family, fmt) in FAMILY.items():
        directory = tmp_path_factory.mktemp(key)
        build_tiny_tokenizer(directory, fmt)
        save_pretrained(init_decoder(ModelConfig.tiny(family, vocab_size=512)), directory)
        out[key] = directory
    return out


REAL = [p for p in sorted(CONFIGS.glob("*.yaml")) if any(k in p.name for k in FAMILY)]


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.name)
def test_real_checkpoint_configs_build_from_a_stand_in(path, stand_ins):
    key = next(k for k in FAMILY if k in path.name)
    cls = _kind(path)
    overrides = [f"model.path={stand_ins[key]}"]
    if cls is SFTRunConfig and "data.paths" in path.read_text():
        overrides.append("data.paths=[/dev/null]")
    cfg = _load(path, overrides)
    if cls is SFTRunConfig:
        tokenizer = load_tokenizer(cfg)
        model = build_sft_model(cfg, tokenizer)
    else:
        tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
        model = build_model(cfg.model, tokenizer, seed=cfg.seed)
    assert model.cfg.family == FAMILY[key][0]
    assert tokenizer.vocab_size <= model.cfg.vocab_size


@pytest.mark.parametrize("config", ["agentic_calculator_tiny.yaml",
                                    "agentic_calculator_ppo_tiny.yaml"])
def test_agentic_cli_smoke_run(tmp_path, config):
    code = main(["agentic", "--config", str(CONFIGS / config),
                 f"run_dir={tmp_path}", "steps=2", "num_eval=2", "group_size=2",
                 "groups_per_step=2", "max_concurrency=8", "engine.max_slots=8",
                 "agent.max_tokens_per_turn=16", "agent.max_turns=2"])
    assert code == 0
    assert (tmp_path / "perf" / "trace.json").exists()
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    if "ppo" in config:  # the critic trained alongside, with PPO's per-token KL penalty
        assert all(np.isfinite(m["value_loss"]) and "reward_kl" in m for m in metrics)
    assert main(["agentic", "env.name=chess"]) == 2


def test_agentic_algorithms_take_their_lengths_from_the_episode_budget():
    dapo = AgenticRunConfig(algorithm="dapo", agent=AgentConfig(max_episode_tokens=300))
    overlong = dapo.algorithm_config().overlong
    assert (overlong.max_response_tokens, overlong.buffer_tokens) == (300, 60)
    dr = AgenticRunConfig(algorithm="dr_grpo", agent=AgentConfig(max_episode_tokens=300))
    assert dr.algorithm_config().policy_loss.max_len_norm == 300
    rloo = AgenticRunConfig(algorithm="rloo", kl_coef=None).algorithm_config()
    assert rloo.kl.mode == "reward" and rloo.kl.coef == 0.05  # taken by the learner step
