"""Optimizers and learning-rate schedules for every nonstop trainer, built from one config.

`build_optimizer` returns a plain `optax.GradientTransformation`: global-norm clipping, then the
update rule (AdamW, SGD or Adafactor) driven by the schedule from `build_schedule`. The schedule is
exposed on its own so that the train step can report the learning rate it applied.

Schedules follow the Hugging Face convention: the warmup ramps linearly from 0 at step 0 to the
peak `learning_rate` at `warmup_steps`, then decays (cosine or linear) to
`learning_rate * min_lr_ratio` at `total_steps` and stays there.

Weight decay is decoupled (AdamW) and, by default, applied only to matrices (ndim >= 2), not to
norm scales and biases, as in most LLM training code. The optimizer state takes the dtype of the
parameters it is initialised with; `TrainState.create` keeps a float32 master copy of the trainable
parameters, so moments are float32 even when the model computes in bfloat16.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import optax

from nonstop.models.validation import check, check_choice, check_int

OptimizerName = Literal["adamw", "sgd", "adafactor"]
ScheduleName = Literal["constant", "cosine", "linear"]
WeightDecayMask = Literal["matrices", "all"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """What to optimize with and how the learning rate moves over training.

    `b1` is the momentum for SGD (0 disables momentum) and the first-moment decay for AdamW;
    Adafactor ignores `b1`, `b2` and `eps`. `max_grad_norm=None` disables clipping.
    """

    name: OptimizerName = "adamw"
    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    weight_decay_mask: WeightDecayMask = "matrices"
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    schedule: ScheduleName = "cosine"
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        owner = "OptimizerConfig"
        check_choice(owner, "name", self.name, OptimizerName)
        check_choice(owner, "schedule", self.schedule, ScheduleName)
        check_choice(owner, "weight_decay_mask", self.weight_decay_mask, WeightDecayMask)
        check(self.learning_rate > 0, owner, "learning_rate", self.learning_rate, "a float > 0")
        check(self.weight_decay >= 0, owner, "weight_decay", self.weight_decay, "a float >= 0")
        check(0 <= self.b1 < 1, owner, "b1", self.b1, "a float in [0, 1)")
        check(0 <= self.b2 < 1, owner, "b2", self.b2, "a float in [0, 1)")
        check(self.eps > 0, owner, "eps", self.eps, "a float > 0")
        check_int(owner, "total_steps", self.total_steps)
        check(0 <= self.warmup_steps <= self.total_steps, owner, "warmup_steps", self.warmup_steps,
              f"an int in [0, total_steps={self.total_steps}]")
        check(0 <= self.min_lr_ratio <= 1, owner, "min_lr_ratio", self.min_lr_ratio,
              "a float in [0, 1]")
        check(self.max_grad_norm is None or self.max_grad_norm > 0, owner, "max_grad_norm",
              self.max_grad_norm, "None (no clipping) or a float > 0")

def build_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """The learning rate as a function of the optimizer step (linear warmup, then decay)."""
    peak = cfg.learning_rate
    decay_steps = max(cfg.total_steps - cfg.warmup_steps, 1)
    if cfg.schedule == "constant":
        decay = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    else:
        decay = optax.linear_schedule(peak, peak * cfg.min_lr_ratio, decay_steps)
    if cfg.warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    return optax.join_schedules([warmup, decay], boundaries=[cfg.warmup_steps])


def build_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """Clipping (if any) chained with the update rule named by `cfg.name`, on `build_schedule`."""
    schedule = build_schedule(cfg)
    mask = _decay_mask(cfg.weight_decay_mask)
    if cfg.name == "adamw":
        rule = optax.adamw(
            schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask
        )
    elif cfg.name == "sgd":
        rule = optax.chain(
            optax.add_decayed_weights(cfg.weight_decay, mask=mask),
            optax.sgd(schedule, momentum=cfg.b1 or None),
        )
    else:
        # Parameter-scale multiplication and update clipping are off so that `learning_rate`
        # means the same absolute step size as for AdamW and clipping stays `max_grad_norm`'s job.
        rule = optax.adafactor(
            schedule,
            multiply_by_parameter_scale=False,
            clipping_threshold=None,
            weight_decay_rate=cfg.weight_decay or None,
            weight_decay_mask=mask,
        )
    if cfg.max_grad_norm is None:
        return rule
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), rule)


def _decay_mask(kind: WeightDecayMask) -> Any:
    if kind == "all":
        return None
    return lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)

