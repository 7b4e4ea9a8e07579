"""`nonstop sft | dpo | orpo --config FILE.yaml [key.sub=value ...]`: supervised and preference tuning.

The config is an `SFTRunConfig` (nonstop/sft/config.py) read from YAML, then the dotted overrides
in order; the subcommand sets `algorithm`. Example configs live in nonstop/recipes/configs/:

    nonstop sft --config nonstop/recipes/configs/sft_tiny.yaml steps=200 run_dir=runs/tiny
    nonstop dpo --config nonstop/recipes/configs/dpo_qwen3_0_6b.yaml model.path=/ckpt/qwen3

A run directory records the resolved config (config.yaml), metrics (metrics.jsonl, tensorboard/),
the perf trace, checkpoints/ and, at the end, export/ (a Hugging Face checkpoint). Running the
same command again resumes from the last complete checkpoint. Bad input — an unknown key, a bad
value, a malformed data line, an example longer than the longest bucket — stops the run with a
message naming the key or the file and line (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from nonstop.models.checkpoint import CheckpointError
from nonstop.recipes.config_io import dump_config, load_config, parse_override
from nonstop.recipes.sft_data import prepare_run
from nonstop.sft.config import SFTRunConfig
from nonstop.sft.trainer import train

COMMANDS = {
    "sft": "supervised fine-tuning (full weights, LoRA, QLoRA)",
    "dpo": "direct preference optimisation (sigmoid, IPO, hinge; reference-free or not)",
    "orpo": "odds-ratio preference optimisation",
}
CONFIG_RECORD = "config.yaml"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sft`, `dpo` and `orpo` on the top-level CLI's subparsers."""
    for name, help_text in COMMANDS.items():
        parser = subparsers.add_parser(
            name, help=help_text, description=__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_arguments(parser)
        parser.set_defaults(run=run, algorithm=name)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.yaml", default=None,
                        help="YAML config (an SFTRunConfig); omitted: all defaults")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="dotted overrides applied after the file, values parsed as YAML")


def load_run_config(algorithm: str, path: str | None, overrides: list[str]) -> SFTRunConfig:
    """The run config for subcommand `algorithm`; naming another algorithm is an error."""
    named = []
    if path is not None and os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            raw = yaml.safe_load(handle)
        if isinstance(raw, dict) and "algorithm" in raw:
            named.append(raw["algorithm"])
    named += [parse_override(o)[1] for o in overrides if parse_override(o)[0] == ("algorithm",)]
    for value in named:
        if value != algorithm:
            raise ValueError(f"algorithm={value!r} conflicts with the subcommand "
                             f"'nonstop {algorithm}'; drop it or run 'nonstop {value}'")
    return load_config(SFTRunConfig, path, [*overrides, f"algorithm={algorithm}"])


def run(args: argparse.Namespace) -> int:
    """Train as configured; returns the process exit code."""
    command = f"nonstop {args.algorithm}"
    try:
        cfg = load_run_config(args.algorithm, args.config, list(args.overrides))
        cfg, tokenizer = prepare_run(cfg)
        os.makedirs(cfg.run_dir, exist_ok=True)
        with open(os.path.join(cfg.run_dir, CONFIG_RECORD), "w", encoding="utf-8") as handle:
            yaml.safe_dump(dump_config(cfg), handle, sort_keys=False)
        result = train(cfg, tokenizer=tokenizer)
    except (ValueError, TypeError, KeyError, FileNotFoundError, CheckpointError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"{command}: error: {message}", file=sys.stderr)
        return 2
    metrics = result.last_metrics or {}
    loss = f"{metrics['loss']:.4g}" if "loss" in metrics else "n/a"
    print(f"{command}: {result.run_dir}: step {result.last_step}/{cfg.steps}, loss {loss}"
          + (f", exported to {result.export_dir}" if result.export_dir else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nonstop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_parser(subparsers)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
