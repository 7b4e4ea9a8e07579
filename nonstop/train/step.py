"""The one jitted training step every nonstop trainer runs: `step(state, batch) -> (state, metrics)`.

A trainer supplies only its loss, as a numerator/denominator pair:

    loss_fn(model, batch, rng) -> (loss_numerator, loss_denominator, aux_metrics)

e.g. the sum of masked token losses and the number of loss tokens, or the sum of pair losses and
the number of pairs. The step differentiates the numerator, sums numerators, gradients and
denominators over `grad_accum_steps` micro-batches with `lax.scan`, and divides once at the end,
so k micro-batches give exactly the update of one big batch (the per-token normalisation is over
the whole batch, not averaged per micro-batch).

Micro-batch j takes rows j, j+k, j+2k, ... of the batch, so a batch sharded along its leading
axis stays evenly spread over devices in every micro-batch.

`aux_metrics` (a dict of scalars) is averaged over micro-batches. The step returns device scalars
— loss, grad_norm (before clipping), learning_rate, tokens (the summed denominator) and the aux
metrics — and never logs or syncs; converting them is `MetricsWriter`'s job.

`setup_train_step` is how every trainer gets its step: from an optimizer config and a model (or
a `TrainState` it already made) it builds the optimizer and schedule, the state, places it on the
mesh by its logical axes and jits the step with matching shardings. The `StepSetup` it returns
also puts batches on the mesh and jits the trainer's other row-sharded forward passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nonstop.train import distributed
from nonstop.train.optim import OptimizerConfig, build_optimizer, build_schedule
from nonstop.train.state import TrainState

PyTree = Any
Metrics = dict[str, jax.Array]
LossFn = Callable[[nnx.Module, PyTree, jax.Array], tuple[jax.Array, jax.Array, Metrics]]
TrainStep = Callable[[TrainState, PyTree], tuple[TrainState, Metrics]]
Fn = TypeVar("Fn", bound=Callable[..., Any])


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    learning_rate: optax.ScalarOrSchedule | None = None,
    grad_accum_steps: int = 1,
    donate: bool = True,
    state_shardings: TrainState | None = None,
    batch_sharding: NamedSharding | PyTree | None = None,
) -> TrainStep:
    """Build the jitted step. It compiles once per batch shape and donates the state if `donate`.

    `learning_rate` (the schedule given to the optimizer) is only used to report the rate applied
    at each step. `state_shardings` (see `state_shardings()`) and `batch_sharding` (one
    `NamedSharding` for every batch leaf, or a matching tree) must be given together; the state
    keeps its layout across steps and metrics come back replicated.
    """
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps={grad_accum_steps!r} is invalid; expected an int >= 1")
    if (state_shardings is None) != (batch_sharding is None):
        raise ValueError(
            "state_shardings and batch_sharding must be given together (both or neither); "
            f"got state_shardings={'set' if state_shardings is not None else None}, "
            f"batch_sharding={'set' if batch_sharding is not None else None}"
        )

    def step(state: TrainState, batch: PyTree) -> tuple[TrainState, Metrics]:
        rng, step_rng = jax.random.split(state.rng)

        def numerator(
            params: nnx.State, micro_batch: PyTree, micro_rng: jax.Array
        ) -> tuple[jax.Array, tuple[jax.Array, Metrics]]:
            model = nnx.merge(state.graphdef, params, state.frozen)
            num, den, aux = loss_fn(model, micro_batch, micro_rng)
            return jnp.asarray(num, jnp.float32), (jnp.asarray(den, jnp.float32), aux)

        grad_fn = jax.value_and_grad(numerator, has_aux=True)

        if grad_accum_steps == 1:
            (num, (den, aux)), grads = grad_fn(state.params, batch, jax.random.fold_in(step_rng, 0))
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        else:
            micro_batches = _split_micro_batches(batch, grad_accum_steps)

            def accumulate(carry: tuple, xs: tuple) -> tuple[tuple, None]:
                micro_batch, index = xs
                if batch_sharding is not None:
                    micro_batch = jax.lax.with_sharding_constraint(
                        micro_batch, _broadcast_sharding(batch_sharding, micro_batch)
                    )
                (n, (d, a)), g = grad_fn(
                    state.params, micro_batch, jax.random.fold_in(step_rng, index)
                )
                g_sum, n_sum, d_sum, a_sum = carry
                g_sum = jax.tree.map(lambda s, x: s + x.astype(jnp.float32), g_sum, g)
                a_sum = jax.tree.map(lambda s, x: s + jnp.asarray(x, jnp.float32), a_sum, a)
                return (g_sum, n_sum + n, d_sum + d, a_sum), None

            first = jax.tree.map(lambda x: x[0], micro_batches)
            aux_shapes = jax.eval_shape(
                lambda p, b, r: grad_fn(p, b, r)[0][1][1], state.params, first, step_rng
            )
            zeros = (
                jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), state.params),
                jnp.zeros((), jnp.float32),
                jnp.zeros((), jnp.float32),
                jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), aux_shapes),
            )
            indices = jnp.arange(grad_accum_steps)
            (grads, num, den, aux), _ = jax.lax.scan(accumulate, zeros, (micro_batches, indices))
            aux = jax.tree.map(lambda a: a / grad_accum_steps, aux)

        # An empty batch (no loss tokens) gives zero gradients rather than NaNs.
        scale = jnp.where(den > 0, 1.0 / jnp.where(den > 0, den, 1.0), 0.0)
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)

        metrics: Metrics = {
            "loss": num * scale,
            "grad_norm": optax.global_norm(grads),
            "tokens": den,
        }
        if learning_rate is not None:
            lr = learning_rate(state.step) if callable(learning_rate) else learning_rate
            metrics["learning_rate"] = jnp.asarray(lr, jnp.float32)
        for name, value in aux.items():
            if name in metrics:
                raise ValueError(f"aux metric {name!r} clashes with a built-in step metric")
            metrics[name] = value
        new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1, rng=rng)
        return new_state, metrics

    jit_kwargs: dict[str, Any] = {"donate_argnums": (0,) if donate else ()}
    if state_shardings is not None:
        mesh = jax.tree.leaves(state_shardings)[0].mesh
        replicated = NamedSharding(mesh, PartitionSpec())
        jit_kwargs["in_shardings"] = (state_shardings, batch_sharding)
        jit_kwargs["out_shardings"] = (state_shardings, replicated)
    return jax.jit(step, **jit_kwargs)


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """A trainer's jitted step, its state (placed on the mesh) and the layout of its batches.

    `batch_sharding` splits a batch's leading axis over the mesh's ("data", "fsdp") devices; None
    means no mesh (one device), where `put` and `jit_rows` add nothing.
    """

    step: TrainStep
    state: TrainState
    batch_sharding: NamedSharding | None

    def put(self, batch: PyTree) -> PyTree:
        """A batch that every process holds whole, on the mesh; each process uploads only its
        own part. Each leaf is split on its own leading axis (rows for token arrays, image slots
        for an image array), so leaves need not share it."""
        if self.batch_sharding is None:
            return batch
        sharding = self.batch_sharding
        return jax.tree.map(lambda leaf: distributed.global_batch_from_full(leaf, sharding), batch)

    def jit_rows(self, fn: Fn) -> Fn:
        """`jax.jit(fn)` for a forward pass over a batch whose outputs are [B, ...] arrays: on a
        mesh they come back split by rows like the batch, ready for the next step's inputs."""
        if self.batch_sharding is None:
            return jax.jit(fn)
        return jax.jit(fn, out_shardings=self.batch_sharding)


def setup_train_step(
    model_or_state: nnx.Module | TrainState,
    loss_fn: LossFn,
    optimizer: OptimizerConfig,
    *,
    seed: int | None = None,
    wrt: nnx.filterlib.Filter | None = None,
    grad_accum_steps: int = 1,
    mesh: Mesh | None = None,
) -> StepSetup:
    """The donated step of `loss_fn` under `optimizer` (its update rule and schedule), with its
    state placed on `mesh` by the variables' logical axes (`distributed.place_train_state`).

    Given a model, the state is made here: the `wrt` parameters (default `nnx.Param`) train, from
    `jax.random.key(seed)`. Given a `TrainState` (one made, or restored, beforehand), it is
    placed as it is; `seed` and `wrt` then belong to whoever made it. Without a mesh the state
    stays where it is and the step is jitted without shardings. Every process of a multi-process
    job passes identical values.
    """
    tx = build_optimizer(optimizer)
    if isinstance(model_or_state, TrainState):
        if seed is not None or wrt is not None:
            raise ValueError(
                "setup_train_step was given a TrainState and "
                f"seed={seed!r}, wrt={wrt!r}; a state already has its RNG and trainable split: "
                "pass the model instead, or leave seed and wrt out"
            )
        state = model_or_state
    else:
        if seed is None:
            raise ValueError(
                "setup_train_step was given a model but no seed; pass seed=<int> (the key the "
                "state's RNG starts from)"
            )
        wrt = nnx.Param if wrt is None else wrt
        state = TrainState.create(model_or_state, tx, rng=jax.random.key(seed), wrt=wrt)
    sharded: dict[str, Any] = {}
    batch_sharding = None
    if mesh is not None:
        state, shardings = distributed.place_train_state(state, mesh)
        batch_sharding = distributed.batch_sharding(mesh)
        sharded = dict(state_shardings=shardings, batch_sharding=batch_sharding)
    step = make_train_step(
        loss_fn,
        tx,
        learning_rate=build_schedule(optimizer),
        grad_accum_steps=grad_accum_steps,
        **sharded,
    )
    return StepSetup(step=step, state=state, batch_sharding=batch_sharding)


def _split_micro_batches(batch: PyTree, k: int) -> PyTree:
    """[B, ...] -> [k, B/k, ...] where micro-batch j holds rows j, j+k, j+2k, ..."""

    def split(x: jax.Array) -> jax.Array:
        b = x.shape[0]
        if b % k:
            raise ValueError(
                f"batch size {b} is not divisible by grad_accum_steps={k}; "
                "use a batch size that is a multiple of it"
            )
        return jnp.swapaxes(x.reshape(b // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def _broadcast_sharding(sharding: NamedSharding | PyTree, batch: PyTree) -> PyTree:
    if isinstance(sharding, NamedSharding):
        return jax.tree.map(lambda _: sharding, batch)
    return sharding
