"""Training metrics to JSONL, TensorBoard and (optionally) Weights & Biases, one step behind.

The jitted step returns device scalars. `MetricsWriter.write(step, metrics)` only stores them;
the previous step's scalars are converted to Python (one `jax.device_get`) when the next step is
written, by which time the device has long finished them, so logging never stalls the step
pipeline. `flush()`/`close()` convert the last one.

Each record gets `step_time_s` (time between consecutive `write` calls, i.e. the steady-state
step time) and `tokens_per_second` (the step's `tokens` metric over that time).

Sinks:
- `metrics.jsonl` in the run directory: one JSON object per step, flushed per line, so a killed
  process loses at most the line being written. On resume (`resume_step`), lines of steps after
  the restored checkpoint, and any torn last line, are dropped so the file stays one history.
- TensorBoard scalars (tensorboardX) under `tensorboard/`, with `purge_step` on resume so that
  TensorBoard hides the superseded steps.
- W&B, only when enabled and `wandb` is importable (it is not a dependency).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from nonstop.train.progress import ProgressBar

JSONL_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Which sinks to write. `wandb_project` and `run_name` are only used by W&B."""

    jsonl: bool = True
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "nonstop"
    run_name: str | None = None
    progress_bar: bool = True


class MetricsWriter:
    """Writes per-step scalar metrics to the configured sinks (use as a context manager)."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        cfg: MetricsConfig = MetricsConfig(),
        *,
        total_steps: int | None = None,
        resume_step: int | None = None,
        run_config: Mapping[str, Any] | None = None,
    ):
        self.run_dir = os.fspath(run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        self._pending: tuple[int, Mapping[str, Any], float, float | None] | None = None
        self._last_write_time: float | None = None
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._progress = None
        if cfg.jsonl:
            path = os.path.join(self.run_dir, JSONL_NAME)
            if resume_step is not None:
                truncate_jsonl(path, resume_step)
            self._jsonl = open(path, "a", encoding="utf-8")
        if cfg.tensorboard:
            # Imported here: tensorboardX imports torch when it is installed, which takes seconds.
            from tensorboardX import SummaryWriter

            purge = resume_step + 1 if resume_step is not None else None
            # A unique suffix: event files are named by the second they were opened in, and a
            # resumed writer must never overwrite the killed run's file.
            self._tb = SummaryWriter(
                os.path.join(self.run_dir, TENSORBOARD_DIR),
                purge_step=purge,
                flush_secs=30,
                filename_suffix=f".{os.getpid()}.{time.time_ns()}",
            )
        if cfg.wandb:
            self._wandb = _start_wandb(cfg, self.run_dir, run_config)
        if cfg.progress_bar and total_steps is not None:
            self._progress = ProgressBar(total_steps, initial_step=resume_step or 0)

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float] | None:
        """Queue `metrics` (device or host scalars) for `step`; write the previously queued step.

        Returns the record written now (the previous step's), or None.
        """
        now = time.perf_counter()
        interval = now - self._last_write_time if self._last_write_time is not None else None
        self._last_write_time = now
        previous, self._pending = self._pending, (step, metrics, time.time(), interval)
        if self._progress is not None:
            self._progress.advance_to(step)
        return self._write_record(previous)

    def flush(self) -> dict[str, float] | None:
        """Write the queued step now (this waits for the device to finish it)."""
        written = self._write_pending()
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()
        return written

    def close(self) -> None:
        self.flush()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._progress is not None:
            self._progress.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_pending(self) -> dict[str, float] | None:
        pending, self._pending = self._pending, None
        return self._write_record(pending)

    def _write_record(self, pending: tuple | None) -> dict[str, float] | None:
        if pending is None:
            return None
        step, metrics, wall_time, interval = pending
        values = {name: _to_float(value) for name, value in jax.device_get(dict(metrics)).items()}
        if interval is not None:
            values["step_time_s"] = interval
            if "tokens" in values and interval > 0:
                values["tokens_per_second"] = values["tokens"] / interval
        if self._jsonl is not None:
            record = {"step": step, "time": wall_time, **values}
            self._jsonl.write(json.dumps(record, allow_nan=True) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, global_step=step, walltime=wall_time)
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if self._progress is not None:
            self._progress.show(values)
        return values


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The complete records of a metrics JSONL file (a torn last line is skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = _parse_line(line)
            if record is not None:
                records.append(record)
    return records


def truncate_jsonl(path: str, resume_step: int) -> None:
    """Keep the records of steps <= resume_step; rewrite atomically (tmp file + rename)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        kept = [line for line in f if _keeps(line, resume_step)]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _keeps(line: str, resume_step: int) -> bool:
    record = _parse_line(line)
    return record is not None and record.get("step", math.inf) <= resume_step


def _parse_line(line: str) -> dict[str, Any] | None:
    if not line.endswith("\n"):
        return None  # torn by a kill mid-write
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _to_float(value: Any) -> float:
    array = np.asarray(value)
    if array.size != 1:
        raise ValueError(f"metrics must be scalars; got an array of shape {array.shape}")
    return float(array.reshape(()))


def _start_wandb(cfg: MetricsConfig, run_dir: str, run_config: Mapping[str, Any] | None) -> Any:
    try:
        import wandb
    except ImportError:
        warnings.warn(
            "MetricsConfig.wandb=True but the wandb package is not installed; "
            "W&B logging is off (pip install wandb to enable it)",
            stacklevel=3,
        )
        return None
    # The run id lives in the run directory so that a resumed run continues the same W&B run.
    id_path = os.path.join(run_dir, "wandb_run_id")
    if os.path.exists(id_path):
        with open(id_path, encoding="utf-8") as f:
            run_id = f.read().strip()
    else:
        run_id = wandb.util.generate_id()
        with open(id_path, "w", encoding="utf-8") as f:
            f.write(run_id)
    return wandb.init(
        project=cfg.wandb_project,
        name=cfg.run_name,
        id=run_id,
        dir=run_dir,
        config=dict(run_config) if run_config is not None else None,
        resume="allow",
    )
