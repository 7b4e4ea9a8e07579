"""`rollout.backend`: which engine runs an agentic run's rollouts (agentic.config.RolloutConfig).

The vLLM run needs the `vllm` extra and is skipped, with the reason, where vLLM is not
importable (run it with that venv's interpreter, docs/engine.md). It starts from the same SFT
fixture as tests/recipes/test_agentic_learning.py, whose model (head_dim 32) vLLM's CPU
attention supports. The remote runs drive `nonstop serve` subprocesses.
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
    engine's on the same weights, and training raises the greedy solve rate on the held-out
    problems by 20 points, as with the in-process engine."""
    demo = DemoConfig(run_dir=str(tmp_path), rl_steps=30, max_staleness=0, pass_k=0,
                      progress=False)
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
    assert summary["steps"] == 30
    assert summary["solve_rate_after"] >= summary["solve_rate_before"] + 0.20, summary


# ---------------------------------------------------------------- remote servers


def test_remote_backend_needs_servers():
    with pytest.raises(ConfigError, match=r"rollout.servers=\[\].*backend=remote"):
        load_config(AgenticRunConfig, TINY, ["rollout.backend=remote"])
    with pytest.raises(ConfigError, match="rollout.servers"):
        load_config(AgenticRunConfig, TINY, ["rollout.backend=remote", "rollout.servers=[x]"])
    cfg = load_config(AgenticRunConfig, TINY, [
        "rollout.backend=remote", "rollout.servers=[http://127.0.0.1:1,http://127.0.0.1:2]"])
    assert cfg.rollout.servers == ("http://127.0.0.1:1", "http://127.0.0.1:2")


def _metric(run_dir: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in
            (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory):
    """The tiny agentic config at staleness 0 for 3 steps, and its initial model written as a
    checkpoint the servers load (the runs push their own weights at start anyway)."""
    from nonstop.models import save_pretrained
    from nonstop.models.source import build_model

    root = tmp_path_factory.mktemp("remote_runs")
    cfg = load_config(AgenticRunConfig, TINY, ["steps=3", "max_staleness=0", "num_eval=8",
                                               "eval_every=0"])
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    save_pretrained(build_model(cfg.model, tokenizer, seed=cfg.seed), root / "ckpt")
    tokenizer.save_pretrained(root / "ckpt")
    return cfg, root


SERVER_FLAGS = ["--max-len", "512", "--max-slots", "16"]


@pytest.mark.slow
def test_agentic_grpo_over_two_servers_follows_the_in_process_run(tiny_run, monkeypatch):
    """rollout.backend=remote over two `nonstop serve` processes at max_staleness 0: the loss of
    every step equals the in-process engine's run (1e-5), and so do the rewards."""
    from tests.engine.test_server import API_KEY, start_server

    cfg, root = tiny_run
    local = dataclasses.replace(cfg, run_dir=str(root / "local"))
    run_agentic(local, model=load_pretrained(root / "ckpt"), progress=False)
    monkeypatch.setenv("ROLLOUT_KEY", API_KEY)
    with (start_server(root / "ckpt", root / "a.log", extra=SERVER_FLAGS) as a,
          start_server(root / "ckpt", root / "b.log", extra=SERVER_FLAGS) as b):
        remote = dataclasses.replace(cfg, run_dir=str(root / "remote"), rollout=RolloutConfig(
            backend="remote", servers=(a, b), api_key_env="ROLLOUT_KEY"))
        run_agentic(remote, model=load_pretrained(root / "ckpt"), progress=False)
    want, got = Path(local.run_dir), Path(remote.run_dir)
    np.testing.assert_allclose(_metric(got, "policy_loss"), _metric(want, "policy_loss"),
                               atol=1e-5, rtol=0)
    np.testing.assert_allclose(_metric(got, "reward_mean"), _metric(want, "reward_mean"),
                               atol=1e-6)
    assert _metric(got, "rollout/servers_up") == [2.0, 2.0, 2.0]


@pytest.mark.slow
def test_a_server_killed_mid_run_costs_episodes_not_the_run(tiny_run, monkeypatch):
    """SIGKILL one of two servers once the first step is written: the run completes its steps
    on the other, and the metrics count the server lost and the requests sent again."""
    import threading
    import time

    from tests.engine.test_server import API_KEY, spawn_server, wait_healthy

    cfg, root = tiny_run
    run_dir = root / "killed"
    monkeypatch.setenv("ROLLOUT_KEY", API_KEY)
    with (spawn_server(root / "ckpt", root / "c.log", extra=SERVER_FLAGS) as (pa, a),
          spawn_server(root / "ckpt", root / "d.log", extra=SERVER_FLAGS) as (pb, b)):
        wait_healthy(pa, a, root / "c.log")
        wait_healthy(pb, b, root / "d.log")

        def kill_after_first_step() -> None:
            metrics = run_dir / "metrics.jsonl"
            while not (metrics.exists() and metrics.read_text().strip()):
                time.sleep(0.05)
            pb.kill()

        killer = threading.Thread(target=kill_after_first_step, daemon=True)
        killer.start()
        cfg = dataclasses.replace(cfg, run_dir=str(run_dir), steps=4, rollout=RolloutConfig(
            backend="remote", servers=(a, b), api_key_env="ROLLOUT_KEY"))
        summary = run_agentic(cfg, model=load_pretrained(root / "ckpt"), progress=False)
        killer.join(timeout=5)
    assert summary["steps"] == 4
    assert _metric(run_dir, "rollout/servers_up")[-1] == 1.0
    assert _metric(run_dir, "rollout/server_failures")[-1] == 1.0
    assert _metric(run_dir, "rollout/rerouted")[-1] >= 1.0
