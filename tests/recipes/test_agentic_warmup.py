"""The SFT warm-up of `nonstop agentic` (recipes/agentic_warmup.py): demonstrations of the
training split with or without the tools, an SFT run in RUN_DIR/warmup that a second call
restores instead of retraining, and clear refusals."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from nonstop.agentic.envs import CalculatorEnv
from nonstop.agentic.envs.calculator import CalculatorConfig
from nonstop.models.source import build_model, build_tokenizer
from nonstop.models.validation import ConfigError
from nonstop.recipes.agentic_recipe import AgenticRunConfig, make_env, run_agentic
from nonstop.recipes.agentic_warmup import WarmupSettings, warm_up, write_demonstrations
from nonstop.recipes.config_io import load_config
from nonstop.recipes.demo import DemoConfig

TINY = "nonstop/recipes/configs/agentic_calculator_tiny.yaml"


def test_settings_are_checked_with_the_key_named():
    with pytest.raises(ConfigError, match=r"WarmupSettings\.tool_fraction=1\.5 is invalid"):
        WarmupSettings(tool_fraction=1.5)
    with pytest.raises(ConfigError, match=r"warmup\.steps=-1 is invalid"):
        load_config(AgenticRunConfig, TINY, ["warmup.steps=-1"])
    with pytest.raises(ConfigError, match=r"tool_fraction=2\.0 is invalid"):
        DemoConfig(tool_demo_fraction=2.0)


def test_the_tool_fraction_shapes_the_demonstrations(tmp_path):
    env = CalculatorEnv(CalculatorConfig(max_operand=20))
    kinds, problems = {}, {}
    for fraction in (0.0, 0.5, 1.0):
        path = tmp_path / f"{fraction}.jsonl"
        write_demonstrations(path, env, n=200, seed=0, tool_fraction=fraction)
        demos = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
        # system, user, then either the call, the tool's result and the answer, or the answer
        kinds[fraction] = [[m["role"] for m in d[2:]] for d in demos]
        for demo, roles in zip(demos, kinds[fraction], strict=True):
            assert [m["role"] for m in demo[:2]] == ["system", "user"]
            assert roles in (["assistant"], ["assistant", "tool", "assistant"])
            assert demo[-1]["content"].lstrip("-").isdigit()
        problems[fraction] = [d[1]["content"] for d in demos]
    assert all(len(r) == 1 for r in kinds[0.0]) and all(len(r) == 3 for r in kinds[1.0])
    assert 70 < sum(len(r) == 3 for r in kinds[0.5]) < 130
    # the same problems in the same order whatever the share: only the answers' form changes
    assert problems[0.0] == problems[0.5] == problems[1.0]


def _params(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_the_warm_up_trains_once_and_is_restored_after(tmp_path):
    cfg = load_config(AgenticRunConfig, TINY, [f"run_dir={tmp_path}", "warmup.steps=3",
                                               "warmup.demonstrations=64"])
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    initial = _params(build_model(cfg.model, tokenizer, seed=cfg.seed))
    first = _params(warm_up(cfg, make_env(cfg.env), tokenizer, tmp_path))
    assert (tmp_path / "warmup" / "demonstrations.jsonl").read_text().count("\n") == 64
    assert any(np.abs(a - b).max() > 1e-4 for a, b in zip(initial, first, strict=True))
    metrics = tmp_path / "warmup" / "sft" / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    again = _params(warm_up(cfg, make_env(cfg.env), tokenizer, tmp_path))
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    # restored from the finished run's checkpoint: no step taken again
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]


def test_a_warm_up_with_a_model_given_is_refused(tmp_path):
    cfg = load_config(AgenticRunConfig, TINY, [f"run_dir={tmp_path}", "warmup.steps=3"])
    model = build_model(cfg.model, build_tokenizer(cfg.tokenizer, cfg.model), seed=0)
    with pytest.raises(ValueError, match=r"warmup\.steps=3 with a model given"):
        run_agentic(cfg, model=model, progress=False)
