"""`rollout.backend`: which engine runs an agentic run's rollouts (agentic.config.RolloutConfig).

The vLLM run needs the `vllm` extra and is skipped, with the reason, where vLLM is not
importable (run it with that venv's interpreter, docs/engine.md). It starts from the same SFT
fixture as tests/recipes/test_agentic_learning.py, whose model (head_dim 32) vLLM's CPU
attention supports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from nonstop.agentic.config import RolloutConfig
from nonstop.engine import Engine, EngineConfig, RolloutEngine
from nonstop.models import load_pretrained
from nonstop.models.source import build_tokenizer
from nonstop.models.validation import ConfigError
from nonstop.recipes.agentic_recipe import AgenticRunConfig, env_backend, run_agentic, solve_rate
from nonstop.recipes.config_io import load_config
from nonstop.recipes.demo import DemoConfig

HAS_VLLM = importlib.util.find_spec("vllm") is not None
FIXTURE = Path(__file__).parent.parent / "fixtures" / "calculator_sft"
TINY = "nonstop/recipes/configs/agentic_calculator_tiny.yaml"


def test_backend_is_validated_with_the_key_named():
    with pytest.raises(ConfigError, match=r"rollout.backend='sglang'.*'local', 'vllm'"):
        load_config(AgenticRunConfig, TINY, ["rollout.backend=sglang"])
    with pytest.raises(ConfigError, match="rollout.vllm_kv_cache_gib"):
        load_config(AgenticRunConfig, TINY, ["rollout.vllm_kv_cache_gib=0"])
    if not HAS_VLLM:
        with pytest.raises(ConfigError, match=r"rollout.backend='vllm'.*nonstop\[vllm\]"):
            load_config(AgenticRunConfig, TINY, ["rollout.backend=vllm"])


def test_the_local_backend_builds_the_in_process_engine():
    engine = RolloutConfig().build(load_pretrained(FIXTURE), EngineConfig(max_slots=2, max_len=64))
    assert isinstance(engine, Engine) and isinstance(engine, RolloutEngine)


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_VLLM,
    reason="vLLM is not importable: install the `vllm` extra and run with that interpreter",
)
def test_agentic_grpo_on_vllm_raises_solve_rate(tmp_path):
    """The shortened calculator recipe (tests/recipes/test_agentic_learning.py) with vLLM doing
    the rollouts and the evaluation: its greedy solve rate before training is the in-process
    engine's on the same weights, and training raises the share of training episodes solved
    (mean of the last 10 steps against the first 10), as with the in-process engine."""
    demo = DemoConfig(
        run_dir=str(tmp_path), rl_steps=40, rl_learning_rate=1e-4, max_staleness=0, progress=False
    )
    cfg = dataclasses.replace(
        demo.agentic(),
        learner="streaming",
        rollout=RolloutConfig(backend="vllm", vllm_kv_cache_gib=0.5),
    )
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    with (
        Engine(load_pretrained(FIXTURE), cfg.engine, tokenizer=tokenizer) as local,
        env_backend(cfg.env) as new_env,
    ):
        local_before = asyncio.run(solve_rate(local, cfg, tokenizer, new_env))
    summary = run_agentic(cfg, model=load_pretrained(FIXTURE), progress=False)
    print(summary)
    assert summary["solve_rate_before"] == pytest.approx(local_before)
    assert summary["steps"] == 40
    solved = np.asarray([json.loads(line)["solved"] for line in
                         (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()])
    assert solved[-10:].mean() >= solved[:10].mean() + 0.05, solved.round(3).tolist()
