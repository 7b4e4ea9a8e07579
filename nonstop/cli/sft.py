"""`nonstop sft | dpo | orpo --config NAME|FILE.yaml [key.sub=value ...]`: supervised and
preference tuning.

The config is an `SFTRunConfig` (nonstop/sft/config.py) read from YAML, then the dotted overrides
in order; the subcommand sets `algorithm`. `nonstop configs` lists the shipped configs;
`--config` takes one's name or a YAML file:

    nonstop sft --config sft_tiny steps=200 run_dir=runs/tiny
    nonstop dpo --config dpo_qwen3_0_6b model.path=/ckpt/qwen3
    nonstop sft --config sft_tiny --print-config > my_sft.yaml

A run directory records the resolved config (config.yaml), metrics (metrics.jsonl, tensorboard/),
the perf trace, checkpoints/ and, at the end, export/ (a Hugging Face checkpoint). Running the
same command again resumes from the last complete checkpoint. Bad input — a malformed or missing
config file, an unknown key, a bad value, a malformed data line, an example longer than the
longest bucket — stops the run with a one-line message naming the key or the file and line
(exit status 2).
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

from nonstop.cli.config_command import (
    add_config_command,
    load_or_report,
    print_config,
    report_error,
)

COMMANDS = {
    "sft": "supervised fine-tuning (full weights, LoRA, QLoRA)",
    "dpo": "direct preference optimisation (sigmoid, IPO, hinge; reference-free or not)",
    "orpo": "odds-ratio preference optimisation",
}
CONFIG_CLASS = "nonstop.sft.config:SFTRunConfig"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sft`, `dpo` and `orpo` on the top-level CLI's subparsers."""
    for name, help_text in COMMANDS.items():
        parser = add_config_command(subparsers, name, help=help_text, description=__doc__,
                                    config_class=CONFIG_CLASS, run=run)
        parser.set_defaults(algorithm=name)


def load_run_config(algorithm: str, path: str | None, overrides: list[str]) -> Any:
    """The `SFTRunConfig` for subcommand `algorithm`; naming another algorithm is an error."""
    from nonstop.recipes.config_io import load_config, parse_override
    from nonstop.sft.config import SFTRunConfig

    named = _algorithm_in_file(path)
    named += [parse_override(o)[1] for o in overrides if parse_override(o)[0] == ("algorithm",)]
    for value in named:
        if value != algorithm:
            raise ValueError(f"algorithm={value!r} conflicts with the subcommand "
                             f"'nonstop {algorithm}'; drop it or run 'nonstop {value}'")
    return load_config(SFTRunConfig, path, [*overrides, f"algorithm={algorithm}"])


def _algorithm_in_file(path: str | None) -> list[Any]:
    """The `algorithm` the YAML file names, if it names one."""
    import yaml

    if path is None:
        return []
    try:
        with open(path, encoding="utf-8") as handle:
            raw = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError):
        return []  # load_config reports an unreadable or malformed file, on one line
    return [raw["algorithm"]] if isinstance(raw, dict) and "algorithm" in raw else []


def run(args: argparse.Namespace) -> int:
    """Train as configured; returns the process exit code."""
    # Imported here so that `nonstop sft --help` does not pay for JAX.
    from nonstop.recipes.run import start_run
    from nonstop.recipes.sft_data import prepare_run
    from nonstop.sft.config import SFTRunConfig
    from nonstop.sft.trainer import train

    command = f"nonstop {args.algorithm}"
    cfg = load_or_report(SFTRunConfig, args, command,
                         load=functools.partial(load_run_config, args.algorithm))
    if cfg is None:
        return 2
    if args.print_config:
        return print_config(cfg)
    try:
        cfg, tokenizer = prepare_run(cfg)
        start_run(cfg, cfg.run_dir)
        result = train(cfg, tokenizer=tokenizer)
    except (ValueError, TypeError, KeyError, FileNotFoundError) as error:
        # ValueError covers ConfigError, CheckpointError and the data errors.
        return report_error(command, error)
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
