"""PPO's value model: the policy's decoder with a scalar head, and the trainer that fits it.

`ValueModel` reads the final hidden states of a `Decoder` through a linear head [D] (zero at
start, so the first values are 0 and the first advantages are the plain returns). Its backbone
starts as a copy of the policy's weights, as verl and OpenRLHF do when the critic is initialised
from the actor's checkpoint; it trains all of its own parameters with its own optimizer.

Alignment follows `nonstop.train.logprobs`: `values[b, t]` is the value of the state *before*
token t, read from the hidden state at t - 1, so it lines up with the log-prob and the loss mask
of token t. Column 0 is 0 (no state precedes a row's first token; it is never a loss token).

`Critic.fit` takes one optimizer step of the clipped value loss on a `ValueBatch`: the packed
`TrainBatch`, the values at rollout time (`old_values`, for the clip) and GAE's returns.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from nonstop import perf
from nonstop.models import Decoder
from nonstop.rl.config import AggregationMode, ValueLossConfig
from nonstop.rl.value_loss import value_loss
from nonstop.train import (
    OptimizerConfig,
    TrainBatch,
    setup_train_step,
    target_mask,
)


class ValueModel(nnx.Module):
    """A decoder backbone and a linear value head: tokens [B,T] -> values float32[B,T]."""

    def __init__(self, backbone: Decoder) -> None:
        self.backbone = backbone
        self.head = nnx.Param(jnp.zeros((backbone.cfg.hidden_size,), jnp.float32))

    @classmethod
    def from_policy(cls, policy: Decoder) -> ValueModel:
        """A value model whose backbone is an independent copy of the policy's current weights."""
        graphdef, state = nnx.split(policy)
        # Fresh buffers: the policy's train step donates its own, which must not be ours.
        return cls(nnx.merge(graphdef, jax.tree.map(jnp.copy, state)))

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array) -> jax.Array:
        x = self.backbone.embed_tokens(tokens)
        h, _ = self.backbone.hidden_states(x, positions, segment_ids, None, None)
        values = jnp.einsum("btd,d->bt", h.astype(jnp.float32), self.head[...])
        return jnp.pad(values[:, :-1], ((0, 0), (1, 0)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class ValueBatch:
    """What one critic step needs: the packed rows, rollout-time values and GAE's returns."""

    batch: TrainBatch
    old_values: jax.Array  # float32[B,T]
    returns: jax.Array  # float32[B,T]


class Critic:
    """The value model's train state, a jitted forward pass and a jitted clipped-value-loss step."""

    def __init__(self, model: ValueModel, loss: ValueLossConfig, *, optimizer: OptimizerConfig,
                 aggregation: AggregationMode = "token_mean", max_segments: int = 64,
                 max_len_norm: int | None = None, grad_accum_steps: int = 1,
                 seed: int = 0, mesh: Mesh | None = None) -> None:
        self.loss = loss
        self.aggregation = aggregation
        self.max_segments = max_segments
        self.max_len_norm = max_len_norm
        # Given the policy trainer's mesh, laid out on it as the policy is.
        setup = setup_train_step(model, self._loss, optimizer, seed=seed,
                                 grad_accum_steps=grad_accum_steps, mesh=mesh)
        self.state, self._step = setup.state, setup.step
        self._values = setup.jit_rows(self._value_pass)

    def _loss(self, model: ValueModel, vb: ValueBatch, rng: jax.Array):
        b = vb.batch
        values = model(b.tokens, b.positions, b.segment_ids)
        mask = target_mask(b.loss_mask, b.segment_ids)
        terms = value_loss(values, old_values=vb.old_values, returns=vb.returns, loss_mask=mask,
                           segment_ids=b.segment_ids, clip_eps=self.loss.clip_eps,
                           mode=self.aggregation, max_segments=self.max_segments,
                           max_len_norm=self.max_len_norm)
        error = jnp.where(mask, values - vb.returns, 0.0)
        count = jnp.maximum(jnp.sum(mask), 1)
        mse = jnp.sum(jnp.square(error)) / count
        mean_return = jnp.sum(jnp.where(mask, vb.returns, 0.0)) / count
        return_var = jnp.sum(jnp.where(mask, jnp.square(vb.returns - mean_return), 0.0)) / count
        metrics = {"value_mse": mse,
                   "value_mean": jnp.sum(jnp.where(mask, values, 0.0)) / count,
                   # 1 - MSE / Var(returns): 0 for a critic that predicts the mean return, 1 for
                   # a perfect one, negative for one worse than the mean (e.g. the initial V=0).
                   "value_explained_var": 1.0 - mse / jnp.maximum(return_var, 1e-8)}
        return self.loss.coef * terms.numerator, terms.denominator, metrics

    def _value_pass(self, params: nnx.State, frozen: nnx.State, batch: TrainBatch) -> jax.Array:
        model = nnx.merge(self.state.graphdef, params, frozen)
        return model(batch.tokens, batch.positions, batch.segment_ids)

    def values(self, batch: TrainBatch) -> jax.Array:
        """float32[B,T] values of the current critic (no gradient), aligned with the tokens."""
        return self._values(self.state.params, self.state.frozen, batch)

    def fit(self, vb: ValueBatch) -> dict[str, jax.Array]:
        """One optimizer step on the clipped value loss; returns the step's metrics."""
        with perf.span(perf.TRAIN_STEP, stage="critic"), perf.device_busy(perf.TRAINER):
            self.state, metrics = self._step(self.state, vb)
            jax.block_until_ready(metrics)
        renamed = {"loss": "value_loss", "grad_norm": "value_grad_norm",
                   "learning_rate": "value_learning_rate"}
        return {renamed.get(k, k): v for k, v in metrics.items() if k != "tokens"}
