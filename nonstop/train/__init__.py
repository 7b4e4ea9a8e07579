"""What every trainer shares: batches and packing, optimizer and schedules, train state, the
jitted step factory, Orbax checkpoints, metric writers and progress."""

from nonstop.train.batch import TrainBatch, target_mask
from nonstop.train.checkpoint import CheckpointConfig, Checkpointer, Restored
from nonstop.train.logprobs import token_logprobs
from nonstop.train.metrics import MetricsConfig, MetricsWriter, read_jsonl
from nonstop.train.optim import OptimizerConfig, build_optimizer, build_schedule
from nonstop.train.packing import (
    BatchPacker,
    PackedBatch,
    PackingConfig,
    PackingStats,
    PackUnit,
    Placement,
    TokenSequence,
    pack_least_padding,
    pack_units,
)
from nonstop.train.progress import ProgressBar
from nonstop.train.state import TrainState, state_shardings
from nonstop.train.step import LossFn, StepSetup, TrainStep, make_train_step, setup_train_step

__all__ = [
    "BatchPacker",
    "CheckpointConfig",
    "Checkpointer",
    "LossFn",
    "MetricsConfig",
    "MetricsWriter",
    "OptimizerConfig",
    "PackUnit",
    "PackedBatch",
    "Placement",
    "PackingConfig",
    "PackingStats",
    "ProgressBar",
    "Restored",
    "StepSetup",
    "TokenSequence",
    "TrainBatch",
    "TrainState",
    "TrainStep",
    "build_optimizer",
    "build_schedule",
    "make_train_step",
    "pack_least_padding",
    "pack_units",
    "read_jsonl",
    "setup_train_step",
    "state_shardings",
    "target_mask",
    "token_logprobs",
]
