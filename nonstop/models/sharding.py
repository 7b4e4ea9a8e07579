"""Logical axis names to mesh axes: one rule table for parameters, caches and activations.

Model code names only logical axes ("embed", "heads", "mlp", ...). A `ShardingRules` maps each
to a mesh axis of the `("data", "fsdp", "tp")` mesh, or to None (replicated). A dimension that
the mapped mesh axis does not divide evenly is replicated instead (small KV-head counts under a
wide `tp`, for example), so any rule table works on any mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nonstop.models.validation import check_ints

MESH_AXES = ("data", "fsdp", "tp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingRules:
    """Logical axis -> mesh axis (or tuple of mesh axes, or None)."""

    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
        ("batch", ("data", "fsdp")),
        ("vocab", "tp"),
        ("embed", "fsdp"),
        ("heads", "tp"),
        ("kv_heads", "tp"),
        ("head_dim", None),
        ("mlp", "tp"),
        ("norm", None),
        ("cache_slots", "data"),
        ("cache_len", None),
        ("lora_rank", None),
    )

    def mesh_axes(self, logical: str | None) -> str | tuple[str, ...] | None:
        if logical is None:
            return None
        for name, target in self.rules:
            if name == logical:
                return target
        raise KeyError(f"no sharding rule for logical axis {logical!r}; "
                       f"known axes: {[n for n, _ in self.rules]}")

    def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int],
             mesh: Mesh) -> PartitionSpec:
        """The PartitionSpec for an array, replicating dims the mesh cannot split evenly."""
        used: set[str] = set()
        out: list[str | tuple[str, ...] | None] = []
        for axis, dim in zip(logical_axes, shape, strict=True):
            target = self.mesh_axes(axis)
            names = (target,) if isinstance(target, str) else tuple(target or ())
            names = tuple(n for n in names if n in mesh.shape and n not in used)
            size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
            if not names or size == 1 or dim % size:
                out.append(None)
                continue
            used.update(names)
            out.append(names[0] if len(names) == 1 else names)
        return PartitionSpec(*out)


DEFAULT_RULES = ShardingRules()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshShape:
    """Sizes of a ("data", "fsdp", "tp") mesh; their product is its number of devices."""

    data: int = 1
    fsdp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        check_ints("MeshShape", self, ("data", "fsdp", "tp"))

    @property
    def num_devices(self) -> int:
        return self.data * self.fsdp * self.tp


def make_mesh(*, data: int = 1, fsdp: int = 1, tp: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "fsdp", "tp") mesh over `devices` (default: all), sizes multiplying to count."""
    devices = list(devices if devices is not None else jax.devices())
    if data * fsdp * tp != len(devices):
        raise ValueError(f"mesh data={data} x fsdp={fsdp} x tp={tp} = {data * fsdp * tp} does not "
                         f"match the {len(devices)} devices given")
    return Mesh(np.asarray(devices).reshape(data, fsdp, tp), MESH_AXES)


def _sharding_for(var: nnx.Variable, mesh: Mesh, rules: ShardingRules) -> NamedSharding:
    axes = getattr(var, "logical_axes", None)
    if axes is None:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, rules.spec(axes, var.get_value().shape, mesh))


def param_shardings(state: nnx.State, mesh: Mesh,
                    rules: ShardingRules = DEFAULT_RULES) -> nnx.State:
    """A state of the same structure holding each variable's NamedSharding as its value."""
    flat = nnx.to_flat_state(state)
    return nnx.from_flat_state([(p, v.replace(_sharding_for(v, mesh, rules))) for p, v in flat])


def shard_model(model: nnx.Module, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> nnx.Module:
    """Place every parameter of `model` on `mesh` according to `rules` (in place)."""
    for _, var in nnx.to_flat_state(nnx.state(model)):
        var.set_value(jax.device_put(var.get_value(), _sharding_for(var, mesh, rules)))
    return model
