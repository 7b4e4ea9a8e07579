"""Orbax checkpoints of a `TrainState`, the data iterator's position and run metadata.

`Checkpointer` wraps `orbax.checkpoint.CheckpointManager`: it saves every `save_every` steps,
keeps the last `keep_last`, and saves asynchronously (the device-to-host copy happens before
`save` returns, so the next step may donate the state; the write finishes in the background and
`wait`/`close` block on it). Each checkpoint holds three items:

- `state`: the trainable params, optimizer state, step and RNG key data. The frozen part of the
  model (e.g. the base weights under LoRA) is not saved: it comes from the pretrained checkpoint.
- `data`: the data iterator's state as JSON (Grain's `iterator.get_state()`), so a resumed run
  continues with the same data order.
- `metadata`: any JSON the trainer wants back (config, run id, policy version...).

Orbax writes each checkpoint into a temporary directory and renames it once complete, so a save
interrupted by SIGKILL never shows up as a step; `restore` falls back to the last complete one
and leftover temporary directories are cleaned up when the next `Checkpointer` opens.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from nonstop.models.validation import ConfigError, check, check_int
from nonstop.train.state import TrainState

JSON = dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how often to checkpoint. `keep_last=None` keeps every checkpoint.

    `directory`: the folder a `Checkpointer` writes; in a run config, the folder that holds the
    run's checkpoint series (`checkpoints/`, `critic_checkpoints/`), null for the run directory
    itself (see `in_run`)."""

    directory: str | None = None
    save_every: int = 1000
    keep_last: int | None = 3
    async_save: bool = True

    def __post_init__(self) -> None:
        owner = "CheckpointConfig"
        check(self.directory is None or bool(self.directory), owner, "directory",
              self.directory, "a path, or null for the run directory")
        check_int(owner, "save_every", self.save_every)
        check(self.keep_last is None or self.keep_last >= 1, owner, "keep_last", self.keep_last,
              "null (keep all) or an int >= 1")

    def in_run(self, run_dir: str | os.PathLike, series: str = "checkpoints") -> CheckpointConfig:
        """The config of one checkpoint series of a run: `directory`/`series`, or
        RUN_DIR/`series` when `directory` is null."""
        parent = self.directory if self.directory is not None else os.fspath(run_dir)
        return dataclasses.replace(self, directory=os.path.join(parent, series))


def _required_directory(cfg: CheckpointConfig) -> str:
    if cfg.directory is None:
        raise ConfigError("Checkpointer needs CheckpointConfig.directory; a run config's "
                          "checkpoint settings get theirs from cfg.in_run(run_dir)")
    return cfg.directory


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpointer.restore` returns."""

    state: TrainState
    step: int
    data_state: JSON | None
    metadata: JSON | None


class Checkpointer:
    """Periodic, asynchronous, atomic checkpoints of a `TrainState` (use as a context manager)."""

    def __init__(self, cfg: CheckpointConfig):
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep_last,
            enable_async_checkpointing=cfg.async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            os.path.abspath(_required_directory(cfg)),
            options=options,
            item_names=("state", "data", "metadata"),
        )

    def should_save(self, step: int) -> bool:
        return step % self.cfg.save_every == 0

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        data_state: JSON | None = None,
        metadata: JSON | None = None,
        force: bool = False,
    ) -> bool:
        """Save `state` as `step` if the step is due (or `force`); True if a save was started.

        `step` is passed by the caller as a Python int so that deciding costs no device sync.
        """
        if not (force or self.should_save(step)):
            return False
        if step in self._manager.all_steps():
            return False
        items = {
            "state": ocp.args.StandardSave(_saved_part(state)),
            "data": ocp.args.JsonSave(data_state if data_state is not None else {}),
            "metadata": ocp.args.JsonSave(metadata if metadata is not None else {}),
        }
        return self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, state: TrainState, *, step: int | None = None) -> Restored | None:
        """Restore checkpoint `step` (default: the latest complete one) into the structure, dtypes
        and shardings of `state`; None if there is no checkpoint yet.

        `state` is typically a freshly built state (its frozen part is kept as is); its leaves may
        also be abstract (`jax.ShapeDtypeStruct` with `sharding`).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        target = jax.tree.map(_abstract, _saved_part(state))
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target),
                data=ocp.args.JsonRestore(),
                metadata=ocp.args.JsonRestore(),
            ),
        )
        saved = restored["state"]
        impl = jax.random.key_impl(state.rng) if isinstance(state.rng, jax.Array) else None
        new_state = state.replace(
            params=saved["params"],
            opt_state=saved["opt_state"],
            step=saved["step"],
            rng=jax.random.wrap_key_data(saved["rng"], impl=impl),
        )
        return Restored(
            state=new_state,
            step=step,
            data_state=restored["data"] or None,
            metadata=restored["metadata"] or None,
        )

    def wait(self) -> None:
        """Block until any asynchronous save has been committed to disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _saved_part(state: TrainState) -> dict[str, Any]:
    # Typed PRNG keys are stored as their raw key data, which Orbax handles like any array.
    return {
        "params": state.params,
        "opt_state": state.opt_state,
        "step": state.step,
        "rng": _key_data(state.rng),
    }


def _key_data(rng: Any) -> Any:
    if isinstance(rng, jax.ShapeDtypeStruct):
        return jax.eval_shape(jax.random.key_data, rng)
    return jax.random.key_data(rng)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, sharding=sharding)
