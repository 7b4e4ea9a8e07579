"""Supervised warm-up of an agentic run: SFT on the environment's own demonstrations of
training-split problems before RL.

A model built from scratch never earns a reward, so `nonstop agentic` can first fine-tune it on
`env.demonstration(task)` conversations (`warmup.steps` > 0), with `nonstop.sft.train`: its
checkpoints, metrics and TensorBoard go to RUN_DIR/warmup, and a resumed run restores the
warmed-up model from there instead of training it again. `warmup.tool_fraction` below 1 makes the
rest of the demonstrations answer at once, without the tools (the task's answer as the first
assistant turn): a mixed warm-up, from which RL learns which of the two pays (`nonstop demo`).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from nonstop.agentic.environment import Environment, draw_task
from nonstop.models import Decoder, Tokenizer
from nonstop.models.chat import Message
from nonstop.models.validation import check, check_int
from nonstop.recipes.warmup import WarmupConfig
from nonstop.train import CheckpointConfig, MetricsConfig, PackingConfig, distributed

if TYPE_CHECKING:
    from nonstop.recipes.agentic_recipe import AgenticRunConfig

WARMUP_DIR = "warmup"  # RUN_DIR/warmup: the demonstrations and the SFT run


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupSettings(WarmupConfig):
    """`nonstop rl`'s warm-up settings (`steps`: 0 for none, `optimizer`, `packing`, here sized
    for multi-turn conversations) and which demonstrations to write."""

    packing: PackingConfig = PackingConfig(buckets=(320,), rows_per_batch=8,
                                           max_segments_per_row=2, overlong="truncate")
    demonstrations: int = 4000  # conversations written, from training-split tasks seed, seed+1..
    tool_fraction: float = 1.0  # the share that use the tools; the rest answer at once

    def __post_init__(self) -> None:
        check_int("WarmupSettings", "steps", self.steps, low=0)
        check_int("WarmupSettings", "demonstrations", self.demonstrations)
        fraction = self.tool_fraction
        check(type(fraction) in (int, float) and 0 <= fraction <= 1, "WarmupSettings",
              "tool_fraction", fraction, "a number in [0, 1]")


def write_demonstrations(path: Path, env: Environment, n: int, seed: int,
                         tool_fraction: float = 1.0) -> None:
    """`n` demonstrations of the training-split tasks `seed`, `seed + 1`, ... as chat JSONL: a
    share `tool_fraction` (drawn per task from `seed`) as `env.demonstration` has them, the
    rest answering the task's question at once with its answer."""
    choice = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            task = draw_task(env, seed + i, "train")
            messages = env.demonstration(task)
            if choice.random() >= tool_fraction:
                if task.answer is None:
                    raise ValueError(f"warmup.tool_fraction={tool_fraction}: task {seed + i} of "
                                     f"{type(env).__name__} has no answer to state without "
                                     "tools; set warmup.tool_fraction=1")
                question = next(k for k, m in enumerate(messages) if m.role == "user")
                messages = [*messages[: question + 1], Message.assistant(task.answer)]
            f.write(json.dumps({"messages": [m.to_dict() for m in messages]}) + "\n")


def warm_up(cfg: AgenticRunConfig, env: Environment, tokenizer: Tokenizer, root: Path, *,
            progress: bool = False) -> Decoder:
    """The model of `cfg.model` after `cfg.warmup.steps` SFT steps on `env`'s demonstrations,
    trained in ROOT/warmup, or restored from there when that run has finished."""
    from nonstop.sft import SFTRunConfig, train
    from nonstop.sft.data import DataConfig

    settings, directory = cfg.warmup, root / WARMUP_DIR
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "demonstrations.jsonl"
    if distributed.is_main_process():  # one writer; every process then reads it
        write_demonstrations(data, env, settings.demonstrations, cfg.seed, settings.tool_fraction)
    distributed.barrier("warmup_demonstrations")
    sft = SFTRunConfig(
        run_dir=str(directory / "sft"), steps=settings.steps, seed=cfg.seed, model=cfg.model,
        tokenizer=cfg.tokenizer,
        data=DataConfig(paths=(str(data),), kind="chat", num_epochs=None, seed=cfg.seed),
        packing=settings.packing, optimizer=settings.optimizer,
        checkpoint=CheckpointConfig(save_every=settings.steps),
        metrics=MetricsConfig(progress_bar=progress), export=False)
    return train(sft, tokenizer=tokenizer).state.model()


__all__ = ["WARMUP_DIR", "WarmupSettings", "warm_up", "write_demonstrations"]
