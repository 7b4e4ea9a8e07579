"""The train state every nonstop trainer carries from step to step, and its sharding.

`TrainState` is a pytree holding a Flax NNX model in functional form: the static graph definition,
the trainable parameters (selected by a `wrt` filter, e.g. only LoRA adapters), the rest of the
model (frozen weights and any other variables, carried along unchanged), the Optax state, the step
count and the RNG key. The jitted step rebuilds the model with `nnx.merge` so that weights enter
jit as arguments, never as baked-in constants.

The trainable parameters are kept as a float32 master copy (`master_dtype`) whatever dtype the
model was built with; the model's own `dtype` decides what it computes in (e.g. bfloat16).

`state_shardings` turns per-variable `PartitionSpec`s (read from NNX sharding metadata by default,
or produced by the caller's logical-axis rules) into a `TrainState`-shaped tree of
`NamedSharding`s for `jax.jit`, `jax.device_put` and Orbax restores. Optimizer moments that mirror
a parameter take that parameter's sharding; everything else (counts, keys, factored moments) is
replicated.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PyTree = Any


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["params", "frozen", "opt_state", "step", "rng"],
    meta_fields=["graphdef"],
)
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Model, optimizer state, step and RNG as one pytree (`graphdef` is static)."""

    graphdef: nnx.GraphDef
    params: nnx.State
    frozen: nnx.State
    opt_state: optax.OptState
    step: jax.Array  # int32[]
    rng: jax.Array  # a typed PRNG key

    @classmethod
    def create(
        cls,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        *,
        rng: jax.Array,
        wrt: nnx.filterlib.Filter = nnx.Param,
        master_dtype: jnp.dtype | None = jnp.float32,
    ) -> TrainState:
        """Split `model` into trainable (`wrt`) and frozen parts and initialise the optimizer.

        Floating trainable parameters are cast to `master_dtype` (None keeps them as they are).
        `rng` may be a typed key (`jax.random.key`) or a legacy uint32 key.
        """
        graphdef, params, frozen = nnx.split(model, wrt, ...)
        if master_dtype is not None:
            params = jax.tree.map(lambda x: _cast_floating(x, master_dtype), params)
        if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.wrap_key_data(rng)
        return cls(
            graphdef=graphdef,
            params=params,
            frozen=frozen,
            opt_state=optimizer.init(params),
            step=jnp.zeros((), jnp.int32),
            rng=rng,
        )

    def model(self) -> nnx.Module:
        """The model with the current parameters (for evaluation, sampling or export)."""
        return nnx.merge(self.graphdef, self.params, self.frozen)

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, **changes)


def state_shardings(
    state: TrainState,
    mesh: Mesh,
    *,
    partition_specs: Callable[[nnx.State], PyTree] = nnx.get_partition_spec,
) -> TrainState:
    """A `TrainState`-shaped tree of `NamedSharding`s over `mesh`.

    `partition_specs` maps an `nnx.State` to a matching tree of `PartitionSpec`s; the default reads
    the variables' own sharding metadata (`sharding_names=...`). Pass the model's logical-axis rules
    here to map logical names to mesh axes. `state` may be concrete or abstract
    (`jax.eval_shape`).
    """
    replicated = NamedSharding(mesh, PartitionSpec())

    def named(specs: PyTree) -> PyTree:
        return jax.tree.map(
            lambda spec: NamedSharding(mesh, spec if spec is not None else PartitionSpec()),
            specs,
            is_leaf=lambda x: x is None or isinstance(x, PartitionSpec),
        )

    params = named(partition_specs(state.params))
    frozen = named(partition_specs(state.frozen))
    return TrainState(
        graphdef=state.graphdef,
        params=params,
        frozen=frozen,
        opt_state=_opt_state_shardings(state.opt_state, state.params, params, replicated),
        step=replicated,
        rng=replicated,
    )


def _opt_state_shardings(
    opt_state: PyTree, params: nnx.State, param_shardings: nnx.State, replicated: NamedSharding
) -> PyTree:
    """Give each optimizer-state leaf that mirrors a parameter (same path suffix and shape) that
    parameter's sharding; replicate the rest. Matching by path works through `optax.chain`,
    `optax.masked` and any other wrapper, unlike initialising with placeholders."""
    by_path = {}
    flat_params = jax.tree_util.tree_leaves_with_path(params)
    flat_shardings = jax.tree.leaves(param_shardings)
    for (path, leaf), sharding in zip(flat_params, flat_shardings, strict=True):
        by_path[tuple(path)] = (jnp.shape(leaf), sharding)

    def pick(path: tuple, leaf: Any) -> NamedSharding:
        for start in range(len(path)):
            match = by_path.get(tuple(path[start:]))
            if match is not None and match[0] == jnp.shape(leaf):
                return match[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, opt_state)


def _cast_floating(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
