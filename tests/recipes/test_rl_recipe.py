"""The `nonstop rl` recipe: configs load, a short run trains end to end, resume continues the same
reward curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nonstop.cli.main import main
from nonstop.models.config import ConfigError
from nonstop.recipes.config_io import load_config
from nonstop.recipes.rl_recipe import RLRunConfig, run_rl

CONFIGS = sorted(Path("nonstop/recipes/configs").glob("*grpo*.yaml")) + sorted(
    Path("nonstop/recipes/configs").glob("*rloo*.yaml")) + sorted(
    Path("nonstop/recipes/configs").glob("*gspo*.yaml")) + sorted(
    Path("nonstop/recipes/configs").glob("dapo*.yaml")) + sorted(
    Path("nonstop/recipes/configs").glob("ppo*.yaml"))

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
        "model.head_dim=8", "warmup.steps=0", "rollout.group_size=4", "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=4", "task.num_eval=8", "engine.max_slots=8",
        "engine.max_len=16", "packing.rows_per_batch=4", "eval_every=2"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_configs_load_and_choose_their_algorithm(path):
    cfg = load_config(RLRunConfig, path)
    assert cfg.algorithm_config().name == cfg.algorithm
    assert path.name.startswith(cfg.algorithm.replace("_token", "_token"))


def test_every_algorithm_has_an_example_config():
    names = {load_config(RLRunConfig, p).algorithm for p in CONFIGS}
    assert names == {"grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "rloo",
                     "ppo"}


def test_bad_keys_and_values_are_named():
    with pytest.raises(ConfigError, match="rollout.group_sise"):
        load_config(RLRunConfig, None, ["rollout.group_sise=4"])
    with pytest.raises(ConfigError, match="algorithm.*'ppo2'.*grpo"):
        load_config(RLRunConfig, None, ["algorithm=ppo2"])
    assert main(["rl", "task.name=gsm8k"]) == 2
    # The batch learner's sampling rounds are gone: the key names what bounds them now.
    with pytest.raises(ConfigError, match="'on_no_variance' has moved.*'max_sampling_rounds'"):
        load_config(RLRunConfig, None, ["on_no_variance=stop"])
    with pytest.raises(ConfigError, match="sync_every"):
        load_config(RLRunConfig, None, ["max_staleness=0", "sync_every=2"])


def _rewards(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [round(x["reward_mean"], 6) for x in lines if "reward_mean" in x]


# PPO also restores its critic, and with a warm-up its KL reference is the saved warmed-up
# model (not a fresh random one), so the resumed curve matches only if both come back.
@pytest.mark.parametrize("config,extra", [
    ("grpo_arithmetic.yaml", []),
    ("ppo_arithmetic.yaml", ["warmup.steps=3"]),
], ids=["grpo", "ppo"])
def test_resumed_run_continues_the_same_reward_curve(tmp_path, config, extra):
    path = f"nonstop/recipes/configs/{config}"
    tiny = [*TINY, *extra]
    straight = load_config(RLRunConfig, path, [*tiny, f"run_dir={tmp_path / 'a'}", "steps=4",
                                               "checkpoint.save_every=2"])
    summary = run_rl(straight, progress=False)
    assert 0.0 <= summary["eval_after"] <= 1.0
    full = _rewards(tmp_path / "a")
    assert len(full) == 4
    first = load_config(RLRunConfig, path, [*tiny, f"run_dir={tmp_path / 'b'}", "steps=2",
                                            "checkpoint.save_every=2"])
    run_rl(first, progress=False)
    resumed = load_config(RLRunConfig, path, [*tiny, f"run_dir={tmp_path / 'b'}", "steps=4",
                                              "checkpoint.save_every=2"])
    run_rl(resumed, progress=False)
    assert _rewards(tmp_path / "b") == full


def test_length_constants_follow_the_generation_budget():
    dr = load_config(RLRunConfig, None, ["algorithm=dr_grpo", "rollout.max_new_tokens=6"])
    assert dr.algorithm_config().policy_loss.max_len_norm == 6
    dapo = load_config(RLRunConfig, None, ["algorithm=dapo", "rollout.max_new_tokens=40"])
    overlong = dapo.algorithm_config().overlong
    assert (overlong.max_response_tokens, overlong.buffer_tokens) == (40, 8)


def test_disaggregated_run_trains_on_its_own_devices(tmp_path):
    # 8 forced CPU devices: the engine decodes on 4 (data 2 x tp 2) while the trainer steps on
    # the other 4 (fsdp 4); weights are resharded from the trainer's devices to the engine's.
    common = [*TINY, "steps=2", "checkpoint.save_every=100"]
    one = run_rl(load_config(RLRunConfig, "nonstop/recipes/configs/grpo_arithmetic.yaml",
                             [*common, f"run_dir={tmp_path / 'one'}"]), progress=False)
    split = run_rl(load_config(RLRunConfig, "nonstop/recipes/configs/grpo_arithmetic.yaml", [
        *common, f"run_dir={tmp_path / 'split'}", "placement.mode=disaggregated",
        "placement.engine.data=2", "placement.engine.tp=2", "placement.trainer.fsdp=4"]),
        progress=False)
    # The first step's rollouts come from identical weights and seeds.
    assert _rewards(tmp_path / "split")[0] == _rewards(tmp_path / "one")[0]
    first = [h for h in split["history"] if "loss" in h]
    assert len(first) == 2 and all(h["optimizer_steps"] >= 1 for h in first)
    assert abs(first[0]["loss"] - [h for h in one["history"] if "loss" in h][0]["loss"]) < 1e-4


def test_remote_backend_keys():
    with pytest.raises(ConfigError, match=r"rollout.servers=\[\].*backend=remote"):
        load_config(RLRunConfig, None, ["rollout.backend=remote"])
    cfg = load_config(RLRunConfig, None, ["rollout.backend=remote",
                                          "rollout.servers=[http://127.0.0.1:9]"])
    assert cfg.rollout.servers == ("http://127.0.0.1:9",) and cfg.rollout.group_size == 8


@pytest.mark.slow
def test_rl_over_a_rollout_server_gives_the_local_rewards(tmp_path, monkeypatch):
    """`nonstop rl` with rollout.backend=remote (one `nonstop serve`, staleness 0): the same
    rewards step for step as the in-process engine."""
    from nonstop.models import save_pretrained
    from nonstop.models.source import build_model, build_tokenizer
    from tests.engine.test_server import API_KEY, start_server

    path = "nonstop/recipes/configs/grpo_arithmetic.yaml"
    common = [*TINY, "steps=3", "checkpoint.save_every=100"]
    local = load_config(RLRunConfig, path, [*common, f"run_dir={tmp_path / 'local'}"])
    run_rl(local, progress=False)
    tokenizer = build_tokenizer(local.tokenizer, local.model)
    save_pretrained(build_model(local.model, tokenizer, seed=local.seed), tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    monkeypatch.setenv("ROLLOUT_KEY", API_KEY)
    with start_server(tmp_path / "ckpt", tmp_path / "server.log",
                      extra=["--max-len", "16", "--max-slots", "8"]) as url:
        remote = load_config(RLRunConfig, path, [
            *common, f"run_dir={tmp_path / 'remote'}", "rollout.backend=remote",
            f"rollout.servers=[{url}]", "rollout.api_key_env=ROLLOUT_KEY"])
        run_rl(remote, progress=False)
    assert _rewards(tmp_path / "remote") == _rewards(tmp_path / "local")
