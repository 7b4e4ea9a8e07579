"""A subcommand driven by one config dataclass: `--config FILE.yaml` plus dotted overrides.

`nonstop rl` and `nonstop agentic` are built this way: the parser, and loading the config with
every bad key or value reported as one line and exit status 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any


def add_config_command(subparsers: argparse._SubParsersAction, name: str, *, help: str,
                       description: str, config_name: str,
                       run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=help, description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE.yaml", default=None,
                        help=f"YAML config (an {config_name}); omitted: all defaults")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="dotted overrides applied after the file, values parsed as YAML")
    parser.set_defaults(run=run)
    return parser


def load_or_report(cls: type, args: argparse.Namespace, prog: str) -> Any | None:
    """The config, or None after printing what was wrong (the caller exits with status 2)."""
    from nonstop.models.config import ConfigError
    from nonstop.recipes.config_io import load_config

    try:
        return load_config(cls, args.config, args.overrides)
    except (ConfigError, ValueError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return None
