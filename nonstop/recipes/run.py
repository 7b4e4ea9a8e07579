"""Opening a run directory: the one place every recipe starts a run.

    run = start_run(cfg, cfg.run_dir)
    run.root          # RUN_DIR: config.yaml, checkpoints, the final model
    run.own           # this process's directory: RUN_DIR, or RUN_DIR/process_N under several

Under `jax.distributed` (NONSTOP_COORDINATOR_ADDRESS etc., see docs/scaling.md) every process
calls it: the runtime is initialised first, and only process 0 writes the shared files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from nonstop.recipes.config_io import dump_config
from nonstop.train import distributed

CONFIG_RECORD = "config.yaml"


@dataclasses.dataclass(frozen=True)
class RunDirs:
    """The run's shared directory and this process's own."""

    root: Path
    own: Path


def start_run(cfg: Any, run_dir: str | Path) -> RunDirs:
    """Initialise `jax.distributed` if configured, create the directories and record `cfg` (the
    resolved config, as `load_config` reads it back) in RUN_DIR/config.yaml."""
    distributed.initialize(distributed.DistributedConfig.from_env())
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    own = Path(distributed.process_run_dir(str(root)))
    own.mkdir(parents=True, exist_ok=True)
    if distributed.is_main_process():
        (root / CONFIG_RECORD).write_text(yaml.safe_dump(dump_config(cfg), sort_keys=False))
    return RunDirs(root=root, own=own)


__all__ = ["CONFIG_RECORD", "RunDirs", "start_run"]
