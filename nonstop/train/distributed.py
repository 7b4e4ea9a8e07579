"""Multi-controller training under `jax.distributed`: one global mesh over every process.

JAX runs multi-host jobs multi-controller: every host runs the same program on its own local
devices, and `jax.distributed.initialize` joins them into one runtime whose `jax.devices()` lists
the devices of all processes. nonstop builds nothing of its own on top: a trainer

1. calls `initialize(DistributedConfig.from_env())` before touching any device (a no-op for a
   single process; on TPU pods, SLURM and Open MPI JAX finds the coordinator by itself);
2. builds one `global_mesh` over all devices, each process's devices contiguous along the
   outermost axes, so tensor parallelism (`tp`) stays inside a host and the batch axes
   (`data`, `fsdp`) span hosts;
3. loads only its own rows of each global batch and assembles the global array with
   `jax.make_array_from_process_local_data` (`global_batch`, `local_rows`), and reads its own
   rows of a global result back with `local_part`;
4. checkpoints with Orbax, which writes and restores collectively when every process calls it
   (`nonstop.train.Checkpointer` needs no change), and logs from process 0 only (`print_main`,
   `process_run_dir`).

On CPU (tests, laptops) cross-process collectives go through gloo, selected here before the
backend starts.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nonstop.models.sharding import DEFAULT_RULES, ShardingRules, make_mesh
from nonstop.models.validation import check
from nonstop.train.state import TrainState, state_shardings

PyTree = Any

ENV_COORDINATOR = "NONSTOP_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "NONSTOP_NUM_PROCESSES"
ENV_PROCESS_ID = "NONSTOP_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "NONSTOP_LOCAL_DEVICE_IDS"
ENV_DISTRIBUTED = "NONSTOP_DISTRIBUTED"  # "auto": let JAX detect the cluster


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How this process joins a multi-process job.

    `coordinator_address=None` lets JAX detect the cluster (Cloud TPU, SLURM, Open MPI,
    Kubernetes); otherwise all three of address, `num_processes` and `process_id` are given.
    """

    coordinator_address: str | None = None  # "host:port" of process 0
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None  # e.g. one process per GPU
    initialization_timeout_s: int = 300
    cpu_collectives: Literal["gloo", "mpi"] = "gloo"

    def __post_init__(self) -> None:
        owner = "DistributedConfig"
        explicit = {"coordinator_address": self.coordinator_address,
                    "num_processes": self.num_processes, "process_id": self.process_id}
        given = {name: value for name, value in explicit.items() if value is not None}
        for name in explicit:
            check(not given or name in given, owner, name, None,
                  f"a value, given {', '.join(f'{k}={v!r}' for k, v in given.items())} (set all "
                  "three of coordinator_address, num_processes and process_id, or none of them to "
                  "let JAX detect the cluster)")
        if self.num_processes is not None:
            check(0 <= (self.process_id or 0) < self.num_processes, owner, "process_id",
                  self.process_id, f"an int in [0, num_processes={self.num_processes})")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> DistributedConfig | None:
        """The config in NONSTOP_COORDINATOR_ADDRESS / _NUM_PROCESSES / _PROCESS_ID (and
        optionally NONSTOP_LOCAL_DEVICE_IDS="0,1"); with NONSTOP_DISTRIBUTED=auto instead, JAX's
        own cluster detection; None (a single process) when neither is set."""
        address = environ.get(ENV_COORDINATOR)
        if not address:
            mode = environ.get(ENV_DISTRIBUTED, "")
            if mode not in ("", "auto"):
                raise ValueError(f"{ENV_DISTRIBUTED}={mode!r} is invalid; expected 'auto' (or "
                                 f"unset, and {ENV_COORDINATOR} etc. for an explicit job)")
            return cls() if mode == "auto" else None
        try:
            devices = environ.get(ENV_LOCAL_DEVICE_IDS)
            return cls(coordinator_address=address,
                       num_processes=int(environ.get(ENV_NUM_PROCESSES, "")),
                       process_id=int(environ.get(ENV_PROCESS_ID, "")),
                       local_device_ids=tuple(int(d) for d in devices.split(",")) if devices
                       else None)
        except ValueError as error:
            raise ValueError(f"{ENV_COORDINATOR} is set, so {ENV_NUM_PROCESSES} and "
                             f"{ENV_PROCESS_ID} must be integers too: {error}") from error


def initialize(cfg: DistributedConfig | None = None) -> None:
    """Join the job described by `cfg` (idempotent). Call before any other JAX device use.

    `cfg=None` is a single-process run and does nothing.
    """
    if cfg is None or jax.distributed.is_initialized():
        return
    # Only read when the CPU client is created; harmless on GPU and TPU.
    jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator_address,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
        local_device_ids=list(cfg.local_device_ids) if cfg.local_device_ids else None,
        initialization_timeout=cfg.initialization_timeout_s,
    )


def is_main_process() -> bool:
    return jax.process_index() == 0


def print_main(*args: object, file: Any = sys.stderr) -> None:
    """`print` on process 0 only, so a message appears once per job, not once per host."""
    if is_main_process():
        print(*args, file=file)


def process_run_dir(run_dir: str) -> str:
    """Where this process writes metrics and traces: RUN_DIR on process 0, RUN_DIR/process_N on
    the others (they record the same steps; separate files never interleave)."""
    index = jax.process_index()
    return run_dir if index == 0 else os.path.join(run_dir, f"process_{index}")


def ordered_devices() -> list[jax.Device]:
    """All devices of the job, grouped by process, so each host owns a contiguous block."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def global_mesh(*, data: int = 1, fsdp: int = 1, tp: int = 1) -> Mesh:
    """A ("data", "fsdp", "tp") mesh over every device of every process.

    Hosts map onto the outer axes: `tp` must divide the devices of one process, so tensor-parallel
    collectives never leave a host (they are the latency-critical ones).
    """
    devices = ordered_devices()
    local = jax.local_device_count()
    if data * fsdp * tp != len(devices):
        raise ValueError(f"mesh data={data} x fsdp={fsdp} x tp={tp} = {data * fsdp * tp} must "
                         f"cover all {len(devices)} devices of the {jax.process_count()} "
                         f"process(es); adjust the mesh sizes")
    if jax.process_count() > 1 and local % tp:
        raise ValueError(f"mesh tp={tp} does not divide the {local} devices of one process; "
                         "tensor parallelism must stay inside a host: use tp <= local devices")
    return make_mesh(data=data, fsdp=fsdp, tp=tp, devices=devices)


def trainer_mesh(*, data: int = 1, fsdp: int = 1, tp: int = 1) -> Mesh | None:
    """A trainer's mesh: with several processes the global mesh over all of their devices;
    with one, None for a single device, else the mesh over the first data x fsdp x tp devices."""
    if jax.process_count() > 1:
        return global_mesh(data=data, fsdp=fsdp, tp=tp)
    n = data * fsdp * tp
    if n == 1:
        return None
    if n > len(jax.devices()):
        raise ValueError(f"mesh data={data} x fsdp={fsdp} x tp={tp} needs {n} devices; "
                         f"{len(jax.devices())} are available: shrink the mesh")
    return make_mesh(data=data, fsdp=fsdp, tp=tp, devices=jax.devices()[:n])


def logical_partition_specs(mesh: Mesh, rules: ShardingRules = DEFAULT_RULES
                            ) -> Callable[[nnx.State], PyTree]:
    """For `state_shardings`: each variable's PartitionSpec from its logical axes and `rules`
    (replicated when it has none)."""

    def spec(var: nnx.Variable) -> nnx.Variable:
        axes = getattr(var, "logical_axes", None)
        if axes is None:
            return var.replace(PartitionSpec())
        return var.replace(rules.spec(axes, var.get_value().shape, mesh))

    return lambda state: jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of a batch split over the mesh's ("data", "fsdp") devices."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def place_train_state(state: TrainState, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES
                      ) -> tuple[TrainState, TrainState]:
    """(state on `mesh` laid out by its variables' logical axes, the matching shardings) — what
    `make_train_step(state_shardings=...)` takes. Every process passes identical values."""
    shardings = state_shardings(state, mesh, partition_specs=logical_partition_specs(mesh, rules))
    return put_global(state, shardings), shardings


def local_rows(sharding: NamedSharding, global_rows: int) -> slice:
    """The rows of a [global_rows, ...] batch whose shards live on this process's devices.

    Only how `sharding` splits the leading axis matters; `global_mesh` keeps each process's
    devices contiguous, so its rows form one block.
    """
    leading = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:1]))
    indices = leading.addressable_devices_indices_map((global_rows,))
    starts = sorted({idx[0].indices(global_rows)[:2] for idx in indices.values()})
    for (_, stop), (start, _) in zip(starts, starts[1:], strict=False):
        if stop != start:
            raise ValueError(f"this process's batch rows {starts} are not contiguous; build the "
                             "mesh with global_mesh() so each process owns one block of rows")
    return slice(starts[0][0], starts[-1][1])


def global_batch(local: PyTree, sharding: NamedSharding, global_rows: int) -> PyTree:
    """Assemble global arrays from this process's rows (`local`, each leaf [local_rows, ...]).

    Every process calls it with its own rows; a single process passes the whole batch.
    """
    expected = local_rows(sharding, global_rows)
    want = expected.stop - expected.start

    def assemble(x: np.ndarray) -> jax.Array:
        x = np.asarray(x)
        if x.shape[0] != want:
            raise ValueError(f"process {jax.process_index()} holds rows {expected.start}:"
                             f"{expected.stop} of the global batch ({want} rows) but was given "
                             f"{x.shape[0]}; give each process global_rows / processes rows")
        return jax.make_array_from_process_local_data(sharding, x, (global_rows, *x.shape[1:]))

    return jax.tree.map(assemble, local)


def global_batch_from_full(full: PyTree, sharding: NamedSharding) -> PyTree:
    """`global_batch` when every process has computed the whole batch: keep only its own rows."""
    if jax.process_count() == 1:
        return jax.device_put(full, sharding)
    rows = jax.tree.leaves(full)[0].shape[0]
    mine = local_rows(sharding, rows)
    return global_batch(jax.tree.map(lambda x: np.asarray(x)[mine], full), sharding, rows)


def local_part(x: jax.Array | np.ndarray) -> np.ndarray:
    """This process's rows of a row-sharded global array, as host numpy: its addressable row
    blocks in order, each once (a block replicated over several local devices is read from one).

    The inverse of `global_batch`: for a batch assembled from this process's rows it returns
    those rows. With one process (or a host array) it is the whole array.
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    rows = x.shape[0]
    blocks: dict[tuple[int, int], jax.Shard] = {}
    for shard in x.addressable_shards:
        if tuple(shard.data.shape[1:]) != tuple(x.shape[1:]):
            raise ValueError(f"local_part takes arrays sharded by rows only; this one of shape "
                             f"{x.shape} is split along another axis too ({x.sharding}); "
                             "reshard it with batch_sharding(mesh) first")
        start, stop, _ = shard.index[0].indices(rows)
        blocks.setdefault((start, stop), shard)
    spans = sorted(blocks)
    for (_, stop), (start, _) in zip(spans, spans[1:], strict=False):
        if stop != start:
            raise ValueError(f"this process's rows {spans} of the global array are not one "
                             "block; build the mesh with global_mesh() so they are")
    return np.concatenate([np.asarray(blocks[span].data) for span in spans])


def put_global(tree: PyTree, shardings: PyTree) -> PyTree:
    """Place a tree whose values every process holds identically (e.g. a model initialised from
    the same seed) onto global shardings; each process uploads only its own shards."""

    def put(x: Any, sharding: NamedSharding) -> jax.Array:
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed keys travel as key data
            return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding),
                                            impl=jax.random.key_impl(x))
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def fetch(tree: PyTree) -> PyTree:
    """Host numpy copies of global arrays (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                        tree)


def max_over_processes(value: int) -> int:
    """The largest `value` any process passed (a collective). E.g. each process packs its own
    trajectories into some number of batches; all must then take that many steps, padding with
    rows whose loss mask is all false."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.asarray([value], np.int64))))


def sum_over_processes(values: Any) -> np.ndarray:
    """Elementwise sum of a small float64 vector over all processes (a collective)."""
    values = np.asarray(values, np.float64)
    if jax.process_count() == 1:
        return values
    return np.asarray(multihost_utils.process_allgather(values)).sum(axis=0)


def gather_int_lists(values: list[int] | tuple[int, ...]) -> list[list[int]]:
    """Every process's list of non-negative ints, in process order (a collective)."""
    if jax.process_count() == 1:
        return [list(values)]
    width = max_over_processes(len(values))
    padded = np.full((max(width, 1),), -1, np.int64)
    padded[:len(values)] = values
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [[int(v) for v in row if v >= 0] for row in rows]


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier called `name`."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


__all__ = [
    "DistributedConfig",
    "gather_int_lists",
    "barrier",
    "batch_sharding",
    "place_train_state",
    "sum_over_processes",
    "trainer_mesh",
    "fetch",
    "global_batch",
    "global_batch_from_full",
    "global_mesh",
    "initialize",
    "is_main_process",
    "local_part",
    "local_rows",
    "logical_partition_specs",
    "max_over_processes",
    "ordered_devices",
    "print_main",
    "process_run_dir",
    "put_global",
]
