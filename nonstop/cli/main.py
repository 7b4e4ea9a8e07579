"""The `nonstop` command: one subcommand per job, each a thin module in this package.

Every subcommand module exposes `add_parser(subparsers)`, which registers its parser(s) and sets
`run` as the default handler. Modules are imported only when their subcommand is named, so
`nonstop --help` and a single job never pay for the others' imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sft": ("nonstop.cli.sft", "supervised fine-tuning (full weights, LoRA, QLoRA)"),
    "dpo": ("nonstop.cli.sft", "direct preference optimisation"),
    "orpo": ("nonstop.cli.sft", "odds-ratio preference optimisation"),
    "rl": ("nonstop.cli.rl", "RL on prompts: GRPO, Dr.GRPO, DAPO, GSPO, GSPO-token, RLOO"),
    "agentic": ("nonstop.cli.agentic", "agentic RL with tools and asynchronous rollouts"),
    "vlm": ("nonstop.cli.vlm", "SFT or DPO of a Gemma 3 vision-language model (LoRA)"),
    "serve": ("nonstop.cli.serve", "serve a checkpoint over the OpenAI-compatible HTTP API"),
    "report": ("nonstop.cli.report", "explain where a run's time went"),
    "demo": ("nonstop.cli.demo", "the built-in end-to-end demo"),
}


def _available(name: str) -> bool:
    module = SUBCOMMANDS[name][0]
    return importlib.util.find_spec(module) is not None


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nonstop", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    if wanted in SUBCOMMANDS and _available(wanted):
        importlib.import_module(SUBCOMMANDS[wanted][0]).add_parser(subparsers)
    for name, (_, help_text) in SUBCOMMANDS.items():
        if name not in subparsers.choices and _available(name):
            subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    result = args.run(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
