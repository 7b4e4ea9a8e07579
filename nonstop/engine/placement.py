"""Where the engine and the trainer run: colocated on one device group, or disaggregated.

- **Colocated** (the default): engine and trainer use the same devices and take turns. The
  engine's weights are the trainer's devices' weights, so a hand-over is a copy in place.
- **Disaggregated**: the devices of one JAX runtime are split into two sub-meshes, the engine's
  and the trainer's. Both work at the same time (the engine's scheduler thread decodes while the
  trainer steps), each on its own devices. Weights reach the engine by *resharding*: the
  engine's `update_weights` puts the trainer's arrays onto the engine's `NamedSharding`s with
  `jax.device_put`, a device-to-device transfer of the runtime (NVLink/ICI), not a round trip
  through the host and not a separate collective group.

Each sub-mesh is a `("data", "fsdp", "tp")` mesh, with the same logical-axis rules as
everywhere else: the engine typically wants `tp` (low latency per token) and `data` (more slots),
the trainer `fsdp`.

    placement = place(PlacementConfig(mode="disaggregated", engine=MeshShape(tp=4),
                                      trainer=MeshShape(fsdp=4)))
    engine = Engine(model, EngineConfig(max_slots=16, max_len=2048), mesh=placement.engine_mesh)
    # ... train on placement.trainer_mesh ...
    engine.update_weights(nnx.state(trained_model), version=1)   # resharded onto the engine

Disaggregation here is within one process (one host's devices); the devices of several hosts
under `jax.distributed` form one global mesh for training (`nonstop.train.distributed`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nonstop.models import KVCache, ModelConfig
from nonstop.models.sharding import (
    DEFAULT_RULES,
    MeshShape,
    ShardingRules,
    make_mesh,
    param_shardings,
)
from nonstop.models.validation import check, check_choice

PlacementMode = Literal["colocated", "disaggregated"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """`colocated`: both meshes over the same `trainer.num_devices` devices (`engine` must use as
    many). `disaggregated`: the engine takes the first `engine.num_devices` devices, the trainer
    the next `trainer.num_devices`."""

    mode: PlacementMode = "colocated"
    engine: MeshShape = MeshShape()
    trainer: MeshShape = MeshShape()

    def __post_init__(self) -> None:
        check_choice("PlacementConfig", "mode", self.mode, PlacementMode)
        check(self.mode != "colocated" or self.engine.num_devices == self.trainer.num_devices,
              "PlacementConfig", "engine", self.engine,
              f"the same number of devices as trainer ({self.trainer.num_devices}): colocated "
              "engine and trainer share their devices (or set mode='disaggregated')")


@dataclasses.dataclass(frozen=True)
class Placement:
    """The engine's and the trainer's meshes."""

    mode: PlacementMode
    engine_mesh: Mesh
    trainer_mesh: Mesh

    @property
    def engine_devices(self) -> frozenset[jax.Device]:
        return frozenset(self.engine_mesh.devices.flat)

    @property
    def trainer_devices(self) -> frozenset[jax.Device]:
        return frozenset(self.trainer_mesh.devices.flat)


def place(cfg: PlacementConfig, devices: Sequence[jax.Device] | None = None) -> Placement:
    """Split `devices` (default: this process's) into the engine's and the trainer's meshes."""
    devices = list(devices if devices is not None else jax.local_devices())
    need = (cfg.trainer.num_devices if cfg.mode == "colocated"
            else cfg.engine.num_devices + cfg.trainer.num_devices)
    if need > len(devices):
        raise ValueError(
            f"{cfg.mode} placement needs {need} devices (engine {cfg.engine}, trainer "
            f"{cfg.trainer}) but {len(devices)} are available; shrink the meshes")

    def mesh(shape: MeshShape, group: Sequence[jax.Device]) -> Mesh:
        return make_mesh(data=shape.data, fsdp=shape.fsdp, tp=shape.tp, devices=group)

    if cfg.mode == "colocated":
        group = devices[:need]
        return Placement(cfg.mode, mesh(cfg.engine, group), mesh(cfg.trainer, group))
    split = cfg.engine.num_devices
    return Placement(cfg.mode, mesh(cfg.engine, devices[:split]),
                     mesh(cfg.trainer, devices[split:need]))


def weight_shardings(state: nnx.State, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES
                     ) -> nnx.State:
    """The engine's sharding of each variable of `state` on `mesh` (by its logical axes)."""
    return param_shardings(state, mesh, rules)


def cache_sharding(cfg: ModelConfig, *, num_slots: int, max_len: int, mesh: Mesh,
                   rules: ShardingRules = DEFAULT_RULES) -> NamedSharding:
    """One sharding for every [S, K, L, H] key/value array: slots over `data`, KV heads over
    `tp` where they divide evenly (replicated otherwise)."""
    shape = (num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
    return NamedSharding(mesh, rules.spec(KVCache.logical_axes(), shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def devices_of(tree: object) -> frozenset[jax.Device]:
    """Every device holding a shard of any array in `tree`."""
    out: set[jax.Device] = set()
    for leaf in jax.tree.leaves(tree):
        out |= set(leaf.sharding.device_set)
    return frozenset(out)


def max_abs_difference(a: object, b: object) -> float:
    """Largest |a - b| over matching leaves of two trees of (possibly differently placed)
    arrays; e.g. the engine's weights against the trainer's after a hand-over."""
    diffs = [float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
    return max(diffs, default=0.0)


__all__ = [
    "MeshShape",
    "Placement",
    "PlacementConfig",
    "cache_sharding",
    "devices_of",
    "max_abs_difference",
    "place",
    "replicated",
    "weight_shardings",
]
