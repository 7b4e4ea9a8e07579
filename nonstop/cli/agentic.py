"""`nonstop agentic --config NAME|FILE.yaml [key.sub=value ...]`: agentic RL with tools.

The config is an `AgenticRunConfig` (nonstop/recipes/agentic_recipe.py). `nonstop configs` lists
the shipped configs (the agentic_* ones run here); `--config` takes one's name or a YAML file.
Without one it runs `agentic_calculator`: `nonstop demo`'s tiny model from scratch, an SFT
warm-up on the calculator's demonstrations, then 40 GRPO steps that raise its held-out solve rate:

    nonstop agentic
    nonstop agentic --config agentic_calculator_tiny
    nonstop agentic --config agentic_calculator_qwen3_0_6b model.path=/ckpt/Qwen3-0.6B

A bad file, key or value stops with a one-line message naming it (exit status 2). The run
checkpoints every `checkpoint.save_every` steps, at the end and on SIGTERM (then it exits with
status 143); running the same command again, or `nonstop agentic --resume RUN_DIR`, continues
from the latest checkpoint. Per-step metrics go to RUN_DIR/metrics.jsonl and TensorBoard as
each step ends.
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
COMMAND = "nonstop agentic"
DEFAULT_CONFIG = "agentic_calculator"  # what no --config runs: `nonstop demo`'s, warm-up first


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_config_command(subparsers, "agentic", help="agentic RL with tools and async "
                              "rollouts", description=__doc__,
                              config_class="nonstop.recipes.agentic_recipe:AgenticRunConfig",
                              run=run, resume=True, default_config=DEFAULT_CONFIG)


def run(args: argparse.Namespace) -> int:
    from nonstop.recipes.agentic_recipe import AgenticRunConfig, run_agentic

    cfg = load_or_report(AgenticRunConfig, args, COMMAND)
    if cfg is None:
        return 2
    if args.print_config:
        return print_config(cfg)
    from nonstop.agentic import NoSamplesError
    from nonstop.recipes.learner_state import RunStopped

    try:
        s = run_agentic(cfg)
    except (*bad_input_errors(), NoSamplesError) as error:
        return report_error(COMMAND, error)
    except RunStopped as stopped:
        print(f"{COMMAND}: {stopped}", file=sys.stderr)
        return STOPPED_EXIT
    print(f"solve rate: {s['solve_rate_before']:.1%} before, {s['solve_rate_after']:.1%} after "
          f"{s['steps']} steps ({s['seconds']:.0f}s); run dir {s['run_dir']}; "
          f"explain the time: nonstop report {s['run_dir']}/perf")
    return 0
