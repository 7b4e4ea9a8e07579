"""`nonstop rl --config FILE.yaml [key.sub=value ...]`: RL on prompts with a verifiable reward.

The config is an `RLRunConfig` (nonstop/recipes/rl_recipe.py); `algorithm` chooses GRPO, Dr.GRPO,
DAPO, GSPO, GSPO-token or RLOO by name. Example configs live in nonstop/recipes/configs/:

    nonstop rl --config nonstop/recipes/configs/grpo_arithmetic.yaml steps=40
    nonstop rl --config nonstop/recipes/configs/grpo_gsm8k_qwen3_0_6b.yaml \\
        model.path=/ckpt/Qwen3-0.6B task.path=/data/gsm8k/train.jsonl

Running the same command again on the same run_dir resumes from its last checkpoint. A bad key
or value stops with a message naming it (exit status 2).
"""

from __future__ import annotations

import argparse

from nonstop.cli.config_command import add_config_command, load_or_report


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_config_command(subparsers, "rl", help="RL on prompts (GRPO, Dr.GRPO, DAPO, GSPO, "
                              "RLOO)", description=__doc__, config_name="RLRunConfig", run=run)


def run(args: argparse.Namespace) -> int:
    from nonstop.recipes.rl_recipe import RLRunConfig, run_rl

    cfg = load_or_report(RLRunConfig, args, "nonstop rl")
    if cfg is None:
        return 2
    summary = run_rl(cfg)
    print(f"eval reward: {summary['eval_before']:.3f} before RL, {summary['eval_after']:.3f} "
          f"after {cfg.steps} {cfg.algorithm} steps ({summary['seconds']:.0f}s); "
          f"run dir {summary['run_dir']}")
    return 0
