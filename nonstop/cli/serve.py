"""`nonstop serve MODEL_DIR`: serve a local Hugging Face checkpoint over the OpenAI-compatible API.

Prints its progress while it loads and compiles, then a ready line with its URL. Binds
127.0.0.1 unless `--host` says otherwise. The API key comes from `--api-key` or, failing
that, the NONSTOP_API_KEY environment variable; with neither, the server is open.
`python -m nonstop.cli.serve MODEL_DIR ...` runs the same command without the top-level CLI.
A directory that is missing or is not a checkpoint (config.json, *.safetensors, tokenizer.json)
stops with a one-line message (exit status 2).

`--max-slots`, `--max-len` and `--on-weight-update` set the engine's most used settings;
`--engine KEY=VALUE` (repeatable, after them) sets any other `EngineConfig` field, the value
read as YAML, e.g. `--engine kv_layout=paged --engine prefill_rows=8 --engine
prefill_chunks=[16,64,256]` (docs/engine.md lists the fields).
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from pathlib import Path

from nonstop.cli.config_command import report_error
from nonstop.engine.config import EngineConfig
from nonstop.engine.server_app import (
    API_KEY_ENV,
    DEFAULT_MAX_LEN,
    DEFAULT_MAX_SLOTS,
    Dtype,
    ServerConfig,
    serve,
)
from nonstop.models.tool_parsers import TOOL_PARSERS
from nonstop.recipes.config_io import load_config


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `serve` subcommand on the top-level CLI's subparsers."""
    parser = subparsers.add_parser(
        "serve", help="serve a checkpoint over the OpenAI-compatible HTTP API",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR",
                        help="a local Hugging Face checkpoint directory (config.json, safetensors, "
                             "tokenizer.json)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1 routes "
                             f"(default: ${API_KEY_ENV} if set, else no key)")
    parser.add_argument("--model-name", default=None,
                        help="the model id clients send (default: the directory's name)")
    parser.add_argument("--max-slots", type=int, default=DEFAULT_MAX_SLOTS,
                        help=f"sequences decoded together (default {DEFAULT_MAX_SLOTS})")
    parser.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN,
                        help=f"context per sequence, prompt plus generation (default "
                             f"{DEFAULT_MAX_LEN})")
    parser.add_argument("--dtype", choices=typing.get_args(Dtype), default="float32",
                        help="compute dtype (default float32)")
    parser.add_argument("--tool-parser", choices=TOOL_PARSERS, default=None,
                        help="how chat tool calls are read from the model's text (default: from "
                             "the chat template's tool-call syntax, else the model family)")
    parser.add_argument("--session-ttl-s", type=float, default=600.0,
                        help="close a session (requests' session_id) idle this many seconds "
                             "(default 600)")
    parser.add_argument("--on-weight-update", choices=("continue", "abort"), default="continue",
                        help="requests running when a trainer posts new weights: continue on "
                             "them, or restart on them with their prefix (default continue)")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="any other EngineConfig field, e.g. prefill_rows=8 or "
                             "kv_layout=paged (repeatable; applied after the flags above)")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig the parsed arguments describe (the env var fills a missing API key)."""
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    engine = load_config(EngineConfig, None, [
        f"max_slots={args.max_slots}", f"max_len={args.max_len}",
        f"on_weight_update={args.on_weight_update}", *args.engine])
    return ServerConfig(model_dir=args.model_dir, host=args.host, port=args.port, api_key=api_key,
                        model_name=args.model_name, engine=engine, dtype=args.dtype,
                        tool_parser=args.tool_parser, log_level=args.log_level,
                        session_ttl_s=args.session_ttl_s)


def check_checkpoint_dir(model_dir: str) -> None:
    """Raise ValueError naming what is missing unless `model_dir` holds a Hugging Face checkpoint
    that `serve` can load (config.json, safetensors weights, a fast tokenizer)."""
    directory = Path(model_dir)
    if not directory.exists():
        raise ValueError(f"{model_dir}: no such directory; pass a local Hugging Face checkpoint "
                         "directory (config.json, *.safetensors, tokenizer.json)")
    if not directory.is_dir():
        raise ValueError(f"{model_dir}: not a directory; pass a local Hugging Face checkpoint "
                         "directory (config.json, *.safetensors, tokenizer.json)")
    missing = [name for name, present in (
        ("config.json", (directory / "config.json").is_file()),
        ("*.safetensors", any(directory.glob("*.safetensors"))),
        ("tokenizer.json", (directory / "tokenizer.json").is_file()),
    ) if not present]
    if missing:
        raise ValueError(f"{model_dir}: not a Hugging Face checkpoint directory: no "
                         f"{', '.join(missing)} (a nonstop run writes one to RUN_DIR/export)")


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the process exit code."""
    try:
        config = config_from_args(args)
        check_checkpoint_dir(config.model_dir)
        serve(config)
    except (ValueError, OSError) as error:
        # ValueError covers ConfigError and CheckpointError from loading the checkpoint; OSError
        # an unreadable file or a port already in use.
        return report_error("nonstop serve", error)
    except KeyError as error:  # a config.json without a key the model family needs
        return report_error("nonstop serve", f"{args.model_dir}: cannot load the checkpoint: "
                            f"missing key {error.args[0]!r} (in config.json?)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nonstop serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
