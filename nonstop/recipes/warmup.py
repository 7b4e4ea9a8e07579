"""Supervised warm-up on a task's own demonstrations, before RL.

RL from a randomly initialised tiny model never sees a reward; a few hundred SFT steps on
`task.demonstration(example)` bring it to a partial solve rate from which group-relative
advantages have signal. The completion (and the end-of-sequence token) is the only target.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nonstop import perf
from nonstop.models import Decoder, Tokenizer
from nonstop.recipes.tasks import Task
from nonstop.sft.preference import sft_loss_fn
from nonstop.train import (
    OptimizerConfig,
    PackingConfig,
    TokenSequence,
    pack_units,
    setup_train_step,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupConfig:
    steps: int = 0
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=3e-3, schedule="constant",
                                                 weight_decay=0.0)
    packing: PackingConfig = PackingConfig(buckets=(64,), rows_per_batch=16,
                                           max_segments_per_row=8)


def demonstration_sequence(task: Task, tokenizer: Tokenizer, example, add_bos: bool = False
                           ) -> TokenSequence:
    prompt = tokenizer.encode(example.prompt)
    if add_bos and tokenizer.bos_id is not None:
        prompt = [tokenizer.bos_id, *prompt]
    completion = tokenizer.encode(task.demonstration(example)) + [tokenizer.eos_ids[0]]
    return TokenSequence(tokens=prompt + completion,
                         loss_mask=[False] * len(prompt) + [True] * len(completion),
                         origin=f"{task.name}:{example.id or example.prompt}")


def supervised_warmup(model: Decoder, tokenizer: Tokenizer, task: Task, cfg: WarmupConfig, *,
                      seed: int = 0, eval_fn=None, eval_every: int = 0) -> Decoder:
    """`cfg.steps` SFT steps on fresh demonstrations; returns the trained model."""
    setup = setup_train_step(model, sft_loss_fn(), cfg.optimizer, seed=seed)
    state, step = setup.state, setup.step
    examples = task.iter_examples("train", seed + 17)

    def units():
        while True:
            yield (demonstration_sequence(task, tokenizer, next(examples)),)

    batches = pack_units(units(), cfg.packing)
    for i in range(cfg.steps):
        packed = next(batches)
        with perf.span(perf.TRAIN_STEP, stage="warmup", step=i):
            state, metrics = step(state, jax.tree.map(jnp.asarray, packed.batch))
        if eval_fn is not None and eval_every and (i + 1) % eval_every == 0:
            eval_fn(i + 1, state.model(), float(metrics["loss"]))
    return state.model()
