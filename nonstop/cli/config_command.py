"""What every config-driven subcommand shares: `--config NAME|FILE.yaml`, dotted overrides,
`--print-config`, the config's keys in `--help`, and bad input as one line on stderr.

`nonstop sft | dpo | orpo | rl | agentic | vlm` are built with `add_config_command`; their `run`
calls `load_or_report` and, under `--print-config`, `print_config`. `--config` takes a YAML file
or the bare name of a config shipped in nonstop/recipes/configs (`nonstop configs` lists them).
Any bad file, key or value is reported by `report_error` as `nonstop CMD: error: ...` on one
line, and the command exits with status 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib
import importlib.resources
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

USAGE_ERROR = 2
CONFIG_SUFFIXES = (".yaml", ".yml")
SHORT_DEFAULT = 40  # longer defaults are left out of --help's key list

Loader = Callable[[str | None, list[str]], Any]


# ------------------------------------------------------------------------------ errors


def one_line(error: BaseException | str) -> str:
    """The error's message on one line (a YAML error spans several: they are joined by '; ')."""
    if isinstance(error, KeyError) and error.args:
        error = str(error.args[0])  # str(KeyError) would quote the message
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


def bad_input_errors() -> tuple[type[BaseException], ...]:
    """What a run raises for bad input (a missing path, a bad config value, a checkpoint or data
    file it cannot use), reported as one line; anything else keeps its traceback, being a bug."""
    from nonstop.models import CheckpointError
    from nonstop.models.config import ConfigError
    from nonstop.recipes.tasks.base import TaskError

    return (ConfigError, CheckpointError, TaskError, FileNotFoundError, NotADirectoryError,
            IsADirectoryError, PermissionError)


def report_error(prog: str, error: BaseException | str) -> int:
    """Print `prog: error: message` as one line on stderr; returns the exit status (2)."""
    print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
    return USAGE_ERROR


# ------------------------------------------------------------------------------ shipped configs


def configs_dir() -> Path:
    """The directory of the shipped configs (package data of nonstop.recipes)."""
    return Path(str(importlib.resources.files("nonstop.recipes").joinpath("configs")))


def shipped_configs() -> dict[str, Path]:
    """Shipped config name (the file name without .yaml) -> its path, sorted by name."""
    directory = configs_dir()
    if not directory.is_dir():
        return {}
    paths = sorted(p for p in directory.iterdir() if p.suffix in CONFIG_SUFFIXES and p.is_file())
    return {p.stem: p for p in paths}


def find_shipped(name: str) -> Path | None:
    """The shipped config called `name` (with or without .yaml), or None."""
    if os.sep in name or (os.altsep and os.altsep in name):
        return None
    for suffix in CONFIG_SUFFIXES:
        name = name.removesuffix(suffix)
    return shipped_configs().get(name)


def unknown_config_hint(name: str) -> str:
    """What to tell someone who named a config that is neither a file nor a shipped config."""
    close = difflib.get_close_matches(Path(name).stem, shipped_configs(), n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return f"{hint}`nonstop configs` lists the shipped configs"


def resolve_config(value: str | None) -> str | None:
    """The YAML file `--config value` names: an existing file, else a shipped config's name.

    Raises ValueError when it is neither (or is a directory), naming close shipped configs."""
    if value is None:
        return None
    if os.path.isdir(value):
        raise ValueError(f"--config {value}: is a directory, not a YAML file")
    if os.path.exists(value):
        return value
    shipped = find_shipped(value)
    if shipped is not None:
        return str(shipped)
    raise ValueError(f"--config {value}: no such file and no shipped config of that name; "
                     f"{unknown_config_hint(value)}")


# ------------------------------------------------------------------------------ the parser


def add_config_command(subparsers: argparse._SubParsersAction, name: str, *, help: str,
                       description: str, config_class: str,
                       run: Callable[[argparse.Namespace], int],
                       resume: bool = False,
                       default_config: str | None = None) -> argparse.ArgumentParser:
    """Register subcommand `name` driven by `config_class` ("module:Class", imported only when
    `--help` lists its keys or `run` loads it); `resume`: with `--resume RUN_DIR`;
    `default_config`: the shipped config that an omitted `--config` means (None: the class's
    defaults)."""
    class_name = config_class.rpartition(":")[2]
    parser = subparsers.add_parser(name, help=help, description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    omitted = (f"the shipped {default_config!r}" if default_config is not None
               else "all defaults")
    parser.add_argument("--config", metavar="NAME|FILE.yaml", default=None,
                        help=f"a YAML file or a shipped config's name (an {class_name}; "
                             f"`nonstop configs` lists them); omitted: {omitted}")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (file, then overrides) as YAML and exit "
                             "without building anything")
    if resume:
        parser.add_argument("--resume", metavar="RUN_DIR", default=None,
                            help="continue the run in RUN_DIR from its latest checkpoint, with "
                                 "the config it recorded (RUN_DIR/config.yaml) and any overrides;"
                                 " the same as rerunning its command")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="dotted overrides applied after the file, values parsed as YAML")
    parser.set_defaults(run=run, default_config=default_config)
    # The key list needs the config class, whose module imports JAX: build it only for --help.
    parser.format_help = functools.partial(_format_help, parser, config_class)
    return parser


def _format_help(parser: argparse.ArgumentParser, config_class: str) -> str:
    if parser.epilog is None:
        parser.epilog = config_keys_text(_import_class(config_class))
    return argparse.ArgumentParser.format_help(parser)


def _import_class(spec: str) -> type:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def config_keys_text(cls: type) -> str:
    """`--help`'s list of the config's top-level keys, with their defaults where short."""
    lines = [f"config keys ({cls.__name__}; set one with key=value, a section's with "
             "section.key=value):"]
    for field in dataclasses.fields(cls):
        if field.init:
            lines.append(f"  {field.name}{_default_text(field)}")
    return "\n".join(lines)


def _default_text(field: dataclasses.Field) -> str:
    import yaml

    from nonstop.recipes.config_io import dump_config

    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "  (required)"
    if dataclasses.is_dataclass(value):
        return f"  (section: {type(value).__name__})"
    text = yaml.safe_dump(dump_config(value), default_flow_style=True, width=1000).strip()
    text = text.removesuffix("...").strip()  # a bare scalar document ends with "..."
    return f": {text}" if len(text) <= SHORT_DEFAULT else ""


# ------------------------------------------------------------------------------ running


def load_or_report(cls: type, args: argparse.Namespace, prog: str, *,
                   load: Loader | None = None) -> Any | None:
    """The config from `args.config` and `args.overrides`, or None after `report_error` said
    what was wrong (the caller exits with status 2). `load(path, overrides)` replaces
    `load_config(cls, ...)` for commands that check more (`nonstop sft` fixes `algorithm`)."""
    from nonstop.models.config import ConfigError
    from nonstop.recipes.config_io import load_config

    try:
        default, overrides = getattr(args, "default_config", None), list(args.overrides)
        if args.config is None and default is not None:
            path = str(find_shipped(default))
        else:
            path = resolve_config(args.config)
        run_dir = getattr(args, "resume", None)
        if run_dir is not None:
            if args.config is not None:
                raise ValueError("--resume RUN_DIR takes the config the run recorded: drop "
                                 "--config (overrides still apply)")
            recorded = Path(run_dir) / "config.yaml"
            if not recorded.is_file():
                raise ValueError(f"--resume {run_dir}: no {recorded} (not a run directory; "
                                 "give the run_dir of an earlier run)")
            path, overrides = str(recorded), [f"run_dir={run_dir}", *overrides]
        if load is None:
            return load_config(cls, path, overrides)
        return load(path, overrides)
    except (ConfigError, ValueError, OSError) as error:
        report_error(prog, error)
        return None


def print_config(cfg: Any) -> int:
    """Print the resolved config as YAML (what `--config` would load back); returns 0."""
    import yaml

    from nonstop.recipes.config_io import dump_config

    sys.stdout.write(yaml.safe_dump(dump_config(cfg), sort_keys=False))
    return 0
