"""`nonstop agentic --config FILE.yaml [key.sub=value ...]`: agentic RL with tools.

The config is an `AgenticRunConfig` (nonstop/recipes/agentic_recipe.py). Example configs live in
nonstop/recipes/configs/agentic_*.yaml:

    nonstop agentic --config nonstop/recipes/configs/agentic_calculator_qwen3_0_6b.yaml \\
        model.path=/ckpt/Qwen3-0.6B

A bad key or value stops with a message naming it (exit status 2).
"""

from __future__ import annotations

import argparse
import sys

from nonstop.models.config import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("agentic", help="agentic RL with tools and async rollouts",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE.yaml", default=None,
                        help="YAML config (an AgenticRunConfig); omitted: all defaults")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="dotted overrides applied after the file, values parsed as YAML")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from nonstop.recipes.agentic_recipe import AgenticRunConfig, run_agentic
    from nonstop.recipes.config_io import load_config

    try:
        cfg = load_config(AgenticRunConfig, args.config, args.overrides)
    except (ConfigError, ValueError) as error:
        print(f"nonstop agentic: {error}", file=sys.stderr)
        return 2
    s = run_agentic(cfg)
    print(f"solve rate: {s['solve_rate_before']:.1%} before, {s['solve_rate_after']:.1%} after "
          f"{s['steps']} steps ({s['seconds']:.0f}s); run dir {s['run_dir']}; "
          f"explain the time: nonstop report {s['run_dir']}/perf")
    return 0
