"""`nonstop agentic --config FILE.yaml [key.sub=value ...]`: agentic RL with tools.

The config is an `AgenticRunConfig` (nonstop/recipes/agentic_recipe.py). Example configs live in
nonstop/recipes/configs/agentic_*.yaml:

    nonstop agentic --config nonstop/recipes/configs/agentic_calculator_qwen3_0_6b.yaml \\
        model.path=/ckpt/Qwen3-0.6B

A bad key or value stops with a message naming it (exit status 2).
"""

from __future__ import annotations

import argparse

from nonstop.cli.config_command import add_config_command, load_or_report


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_config_command(subparsers, "agentic", help="agentic RL with tools and async "
                              "rollouts", description=__doc__, config_name="AgenticRunConfig",
                              run=run)


def run(args: argparse.Namespace) -> int:
    from nonstop.recipes.agentic_recipe import AgenticRunConfig, run_agentic

    cfg = load_or_report(AgenticRunConfig, args, "nonstop agentic")
    if cfg is None:
        return 2
    s = run_agentic(cfg)
    print(f"solve rate: {s['solve_rate_before']:.1%} before, {s['solve_rate_after']:.1%} after "
          f"{s['steps']} steps ({s['seconds']:.0f}s); run dir {s['run_dir']}; "
          f"explain the time: nonstop report {s['run_dir']}/perf")
    return 0
