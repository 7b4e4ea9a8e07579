"""`nonstop configs [NAME] [--path]`: the recipe configs shipped inside the package.

Without NAME, lists every shipped config: its name, the command that runs it and the first
sentence of its leading comment. With NAME, prints the YAML file (or, with --path, where it is).
A shipped config's bare name works wherever a command takes `--config`:

    nonstop configs
    nonstop configs grpo_arithmetic
    nonstop rl --config grpo_arithmetic steps=40
    cp "$(nonstop configs sft_tiny --path)" my_sft.yaml
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from nonstop.cli.config_command import (
    configs_dir,
    find_shipped,
    report_error,
    shipped_configs,
    unknown_config_hint,
)

DESCRIPTION_WIDTH = 72
# A leading comment shows how to run the config: "#   nonstop rl --config ..."
_COMMAND = re.compile(r"^nonstop (\w+)\b.*--config")
# A sentence ends at ". " before a capital letter, but not after "e.g." or "i.e.".
_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z])")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "configs", help="list the shipped recipe configs, or print one", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", metavar="NAME", nargs="?", default=None,
                        help="a shipped config to print (e.g. grpo_arithmetic)")
    parser.add_argument("--path", action="store_true",
                        help="print the config file's path instead of its contents")
    parser.set_defaults(run=run)
    return parser


def leading_comment(path: Path) -> list[str]:
    """The lines of the comment block a config file opens with, '#' and indent removed."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return lines


def command_of(path: Path) -> str | None:
    """The `nonstop` subcommand the config's leading comment runs it with, if it says."""
    for line in leading_comment(path):
        match = _COMMAND.match(line)
        if match:
            return match.group(1)
    return None


def description_of(path: Path, width: int = DESCRIPTION_WIDTH) -> str:
    """The first sentence of the leading comment (up to the usage example), at most `width`."""
    prose = []
    for line in leading_comment(path):
        if _COMMAND.match(line):
            break
        prose.append(line)
    text = " ".join(" ".join(prose).split())
    end = _SENTENCE_END.search(text)
    text = (text[: end.start() + 1] if end else text).rstrip(":")
    if len(text) > width:
        text = text[: width - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."
    return text


def run(args: argparse.Namespace) -> int:
    if args.name is None:
        if args.path:
            print(configs_dir())
            return 0
        return _list()
    path = find_shipped(args.name)
    if path is None:
        return report_error("nonstop configs",
                            f"no shipped config {args.name!r}; {unknown_config_hint(args.name)}")
    if args.path:
        print(path)
    else:
        sys.stdout.write(path.read_text(encoding="utf-8"))
    return 0


def _list() -> int:
    configs = shipped_configs()
    if not configs:
        return report_error("nonstop configs", f"no configs in {configs_dir()}; the package "
                            "was installed without its data files")
    rows = [(name, command_of(path) or "?", description_of(path))
            for name, path in configs.items()]
    name_width = max(len(r[0]) for r in rows)
    command_width = max(len("COMMAND"), *(len(r[1]) for r in rows))
    print(f"{'NAME':<{name_width}}  {'COMMAND':<{command_width}}  DESCRIPTION")
    for name, command, description in rows:
        print(f"{name:<{name_width}}  {command:<{command_width}}  {description}".rstrip())
    print(f"\nrun one:  nonstop COMMAND --config NAME [key.sub=value ...]\n"
          f"show one: nonstop configs NAME [--path]   ({configs_dir()})")
    return 0
