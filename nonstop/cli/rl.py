"""`nonstop rl --config NAME|FILE.yaml [key.sub=value ...]`: RL on prompts with a verifiable reward.

The config is an `RLRunConfig` (nonstop/recipes/rl_recipe.py); `algorithm` chooses PPO, GRPO,
Dr.GRPO, DAPO, GSPO, GSPO-token or RLOO by name. `nonstop configs` lists the shipped configs;
`--config` takes one's name or a YAML file:

    nonstop rl --config grpo_arithmetic steps=40
    nonstop rl --config grpo_gsm8k_qwen3_0_6b \\
        model.path=/ckpt/Qwen3-0.6B task.path=/data/gsm8k/train.jsonl
    nonstop rl --config grpo_arithmetic --print-config > my_rl.yaml

Running the same command again on the same run_dir resumes from its last checkpoint. A bad file,
key or value stops with a one-line message naming it (exit status 2).
"""

from __future__ import annotations

import argparse
import sys

from nonstop.cli.config_command import (
    add_config_command,
    bad_input_errors,
    load_or_report,
    print_config,
    report_error,
)

STOPPED_EXIT = 128 + 15  # stopped by SIGTERM, checkpoint written
COMMAND = "nonstop rl"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_config_command(subparsers, "rl", help="RL on prompts (PPO, GRPO, Dr.GRPO, DAPO, "
                              "GSPO, RLOO)", description=__doc__,
                              config_class="nonstop.recipes.rl_recipe:RLRunConfig", run=run,
                              resume=True)


def run(args: argparse.Namespace) -> int:
    from nonstop.recipes.learner_state import RunStopped
    from nonstop.recipes.rl_recipe import RLRunConfig, run_rl

    cfg = load_or_report(RLRunConfig, args, COMMAND)
    if cfg is None:
        return 2
    if args.print_config:
        return print_config(cfg)
    try:
        summary = run_rl(cfg)
    except bad_input_errors() as error:
        return report_error(COMMAND, error)
    except RunStopped as stopped:
        print(f"{COMMAND}: {stopped}", file=sys.stderr)
        return STOPPED_EXIT
    print(f"eval reward: {summary['eval_before']:.3f} before RL, {summary['eval_after']:.3f} "
          f"after {cfg.steps} {cfg.algorithm} steps ({summary['seconds']:.0f}s); "
          f"run dir {summary['run_dir']}")
    return 0
