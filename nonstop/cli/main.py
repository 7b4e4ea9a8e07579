"""The `nonstop` command: one subcommand per job, each a thin module in this package.

Every subcommand module exposes `add_parser(subparsers)`, which registers its parser(s) and sets
`run` as the default handler. Modules are imported only when their subcommand is named, so
`nonstop --help` and a single job never pay for the others' imports. `python -m nonstop` runs
the same command.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sft": ("nonstop.cli.sft", "supervised fine-tuning (full weights, LoRA, QLoRA)"),
    "dpo": ("nonstop.cli.sft", "direct preference optimisation"),
    "orpo": ("nonstop.cli.sft", "odds-ratio preference optimisation"),
    "rl": ("nonstop.cli.rl", "RL on prompts: PPO, GRPO, Dr.GRPO, DAPO, GSPO, GSPO-token, RLOO"),
    "agentic": ("nonstop.cli.agentic", "agentic RL with tools and asynchronous rollouts"),
    "vlm": ("nonstop.cli.vlm", "SFT or DPO of a Gemma 3 vision-language model (LoRA)"),
    "serve": ("nonstop.cli.serve", "serve a checkpoint over the OpenAI-compatible HTTP API"),
    "export": ("nonstop.cli.export",
               "export a run's model: merged Hugging Face checkpoint or PEFT adapters"),
    "report": ("nonstop.cli.report", "explain where a run's time went"),
    "configs": ("nonstop.cli.configs", "list the shipped recipe configs, or print one"),
    "demo": ("nonstop.cli.demo", "the built-in end-to-end demo"),
}

DESCRIPTION = ("JAX-native post-training for LLMs and tool-using agents: SFT, DPO, ORPO, RL and "
               "agentic RL.")


def version() -> str:
    """The installed distribution's version; the package's own when it is not installed."""
    try:
        return importlib.metadata.version("nonstop")
    except importlib.metadata.PackageNotFoundError:
        from nonstop import __version__

        return __version__


def _available(name: str) -> bool:
    module = SUBCOMMANDS[name][0]
    return importlib.util.find_spec(module) is not None


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nonstop", description=DESCRIPTION,
        epilog="`nonstop COMMAND --help` shows a command's options; `nonstop configs` lists the "
               "recipe configs that ship with nonstop.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
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
    try:
        result = args.run(args)
    except BrokenPipeError:
        # The reader went away (`nonstop configs | head`): stop quietly, as other tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
