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
from typing import Any, Literal, get_args

import jax
import optax

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
        _check_choice("name", self.name, OptimizerName)
        _check_choice("schedule", self.schedule, ScheduleName)
        _check_choice("weight_decay_mask", self.weight_decay_mask, WeightDecayMask)
        if not self.learning_rate > 0:
            _fail("learning_rate", self.learning_rate, "a float > 0")
        if not self.weight_decay >= 0:
            _fail("weight_decay", self.weight_decay, "a float >= 0")
        if not 0 <= self.b1 < 1:
            _fail("b1", self.b1, "a float in [0, 1)")
        if not 0 <= self.b2 < 1:
            _fail("b2", self.b2, "a float in [0, 1)")
        if not self.eps > 0:
            _fail("eps", self.eps, "a float > 0")
        if self.total_steps < 1:
            _fail("total_steps", self.total_steps, "an int >= 1")
        if not 0 <= self.warmup_steps <= self.total_steps:
            _fail(
                "warmup_steps", self.warmup_steps, f"an int in [0, total_steps={self.total_steps}]"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            _fail("min_lr_ratio", self.min_lr_ratio, "a float in [0, 1]")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            _fail("max_grad_norm", self.max_grad_norm, "None (no clipping) or a float > 0")


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


def _check_choice(field: str, value: object, choices: Any) -> None:
    valid = get_args(choices)
    if value not in valid:
        _fail(field, value, f"one of {valid}")


def _fail(field: str, value: object, valid: str) -> None:
    raise ValueError(f"OptimizerConfig.{field}={value!r} is invalid; expected {valid}")
