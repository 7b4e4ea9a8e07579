"""`nonstop demo`: train a tiny model from scratch into a calculator-using agent on a CPU.

SFT on generated demonstrations (half call the calculator, half answer without it), then agentic
GRPO with asynchronous rollouts; prints the held-out solve rate before and after RL, the engine
busy fraction, and where the run directory, the TensorBoard logs and the Perfetto trace are.
See nonstop/recipes/demo.py.
"""

from __future__ import annotations

import argparse
import dataclasses


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("demo", help="the built-in end-to-end demo",
                                   description=__doc__)
    parser.add_argument("--run-dir", default="runs/demo", help="where the run writes everything")
    parser.add_argument("--quick", action="store_true", help="a shortened run (about a minute)")
    parser.add_argument("--sft-steps", type=int, default=None)
    parser.add_argument("--rl-steps", type=int, default=None)
    parser.add_argument("--rl-learning-rate", type=float, default=None)
    parser.add_argument("--tool-demo-fraction", type=float, default=None,
                        help="the share of SFT demonstrations that call the calculator "
                             "(default 0.5; the rest answer without it)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from nonstop.recipes.demo import DemoConfig, run_demo

    cfg = DemoConfig.quick(args.run_dir) if args.quick else DemoConfig(run_dir=args.run_dir)
    changes = {k: v for k, v in (("sft_steps", args.sft_steps), ("rl_steps", args.rl_steps),
                                 ("rl_learning_rate", args.rl_learning_rate),
                                 ("tool_demo_fraction", args.tool_demo_fraction))
               if v is not None}
    cfg = dataclasses.replace(cfg, **changes)
    s = run_demo(cfg)
    print()
    print(f"solve rate on {cfg.eval_problems} held-out problems: "
          f"{s['solve_rate_before_rl']:.1%} after SFT -> {s['solve_rate_after_rl']:.1%} after "
          f"{s['rl_steps']} agentic GRPO steps")
    if cfg.pass_k:
        k = cfg.pass_k
        print(f"pass@{k} (one of {k} samples at the training temperature solves it): "
              f"{s[f'pass@{k}_before_rl']:.1%} -> {s[f'pass@{k}_after_rl']:.1%}")
    print(f"engine busy during RL: {s['engine_busy_fraction']:.1%}")
    print(f"time: SFT {s['sft_seconds']:.0f}s, RL {s['rl_seconds']:.0f}s, "
          f"total {s['seconds']:.0f}s")
    print(f"run directory:    {s['run_dir']}")
    print(f"TensorBoard logs: {s['tensorboard']}")
    print(f"Perfetto trace:   {s['trace']}  (open in ui.perfetto.dev)")
    print(f"explain the time: nonstop report {s['run_dir']}/perf")
    return 0
