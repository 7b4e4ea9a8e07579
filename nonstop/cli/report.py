"""`nonstop report RUN_DIR`: where a run's time went, who waited on whom, and a timeline picture.

Reads RUN_DIR/events.jsonl (a finished, crashed or half-written run) and prints the report: each
role's busy time by stage and idle time by named cause, episode time by stage, advice, the
per-stage table, rates, queue depths, staleness and MFU (with --peak-flops-per-s), and which of
the run's files are missing. Writes the timeline PNG to RUN_DIR/timeline.png unless --png says
elsewhere or --no-png. Exit status: 0 when there were events to report, 1 when there were none.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from nonstop.cli.config_command import report_error
from nonstop.perf import read_events, write_trace
from nonstop.perf.recorder import EVENTS_FILE, TRACE_FILE
from nonstop.perf.report import build_report
from nonstop.perf.timeline import render_timeline

COMMAND = "nonstop report"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `report` subcommand on the top-level CLI's subparsers."""
    parser = subparsers.add_parser(
        "report", help="explain where a run's time went", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    _add_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds events.jsonl)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead")
    parser.add_argument(
        "--png",
        metavar="PATH",
        default=None,
        help="where to write the timeline picture (default RUN_DIR/timeline.png)",
    )
    parser.add_argument("--no-png", action="store_true", help="do not draw the timeline")
    parser.add_argument(
        "--peak-flops-per-s",
        type=float,
        default=None,
        metavar="F",
        help="the device's peak FLOP/s, for model FLOPs utilisation",
    )
    parser.add_argument("--write-trace", action="store_true",
                        help="(re)build RUN_DIR/trace.json from events.jsonl first (a crashed "
                             "run has none)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    run_dir = args.run_dir
    if not os.path.exists(run_dir):
        return report_error(COMMAND, f"{run_dir!r} does not exist; pass a run directory (it "
                            f"holds {EVENTS_FILE})")
    if not os.path.isdir(run_dir):
        return report_error(COMMAND, f"{run_dir!r} is not a directory; pass a run directory "
                            f"(it holds {EVENTS_FILE})")
    if args.peak_flops_per_s is not None and not args.peak_flops_per_s > 0:
        return report_error(COMMAND, f"--peak-flops-per-s {args.peak_flops_per_s}; valid: > 0")
    events_path = os.path.join(run_dir, EVENTS_FILE)
    if args.write_trace and os.path.exists(events_path):
        write_trace(events_path, os.path.join(run_dir, TRACE_FILE))
    log = read_events(run_dir)
    report = build_report(run_dir, peak_flops_per_s=args.peak_flops_per_s, log=log)
    png = None
    if not args.no_png and log.events:
        png = args.png or os.path.join(run_dir, "timeline.png")
        try:
            render_timeline(
                log.events,
                png,
                thread_names=log.thread_names,
                title=f"{os.path.abspath(run_dir)}  {report.window_s:.3f} s",
            )
        except OSError as err:
            print(f"nonstop report: could not write the timeline {png!r}: {err}", file=sys.stderr)
            png = None
    if args.json:
        print(json.dumps({**report.to_json(), "timeline_png": png}, indent=1, default=str))
    else:
        print(report.text())
        if png:
            print(f"timeline: {png}")
    if not log.events:
        print(f"nonstop report: no events in {run_dir!r}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nonstop report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
