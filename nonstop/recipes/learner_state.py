"""What `nonstop rl` and `nonstop agentic` checkpoint and resume: one streaming learner's state.

    checkpoints = LearnerCheckpoints.open(cfg.checkpoint, run, with_critic=ppo)
    resumed = checkpoints.restore(trainer, run)          # None on a fresh run
    ...
    checkpoints.save(step, trainer, learner.cursor, data={"eval_before": x}, force=last)

A checkpoint is the trainer's state (policy or LoRA adapters, optimizer, step count; PPO's
critic in its own series at the same step), written atomically by Orbax, with the learner's
position as JSON: its `GroupCursor` (group ids drawn but not trained or dropped, and the next
id) plus anything the recipe adds. The KL reference is not saved: it is the initial policy,
which the recipe rebuilds deterministically (same model source and seed, or the run's saved
warm-up). Episodes carry seeds derived from (seed, group id, index), so a resumed run that
regenerates its pending groups first draws exactly the samples the uninterrupted run would have
at `max_staleness: 0`, and at any staleness trains every group once. With several processes
each draws its own block of every step's groups: the checkpoint holds every process's pending
ids (gathered, in process order) and the highest id any drew, and each resumed process
regenerates its own pending groups, then goes on from the next step block.

`TerminationGuard` turns SIGTERM into a checkpoint at the next step boundary and a clean stop
(`RunStopped`).
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import jax

from nonstop.agentic.streaming import GroupCursor, process_group_ids
from nonstop.recipes.run import RunDirs
from nonstop.rl.policy_trainer import PolicyTrainer
from nonstop.train import CheckpointConfig, Checkpointer, distributed

CURSOR_KEY = "group_cursor"
LEGACY_CONSUMED_KEY = "examples_consumed"  # checkpoints of single-turn runs before the cursor
BY_PROCESS_KEY = "pending_by_process"  # with several processes: each one's pending group ids
NEXT_BY_PROCESS_KEY = "next_by_process"  # and each one's next id


class RunStopped(RuntimeError):
    """The run stopped on SIGTERM after writing a checkpoint; running it again resumes."""


@dataclasses.dataclass(frozen=True)
class Resumed:
    """A restored checkpoint: the learner step it was written after, the group cursor, and the
    recipe's own data."""

    step: int
    cursor: GroupCursor
    data: dict[str, Any]


@dataclasses.dataclass
class LearnerCheckpoints:
    """The policy's checkpoints (RUN_DIR/checkpoints) and, for PPO, the critic's
    (RUN_DIR/critic_checkpoints)."""

    policy: Checkpointer
    critic: Checkpointer | None

    @classmethod
    def open(cls, cfg: CheckpointConfig, run: RunDirs, with_critic: bool) -> LearnerCheckpoints:
        critic = Checkpointer(cfg.in_run(run.root, "critic_checkpoints")) if with_critic else None
        return cls(Checkpointer(cfg.in_run(run.root)), critic)

    def restore(self, trainer: PolicyTrainer, run: RunDirs) -> Resumed | None:
        """Restore the trainer in place from the latest complete checkpoint (PPO: the latest
        step both the policy and the critic finished writing); None on a fresh run."""
        steps = set(self.policy.all_steps())
        if self.critic is not None:
            critic_steps = set(self.critic.all_steps())
            if steps and not steps & critic_steps:
                raise FileNotFoundError(
                    f"{run.root}: policy checkpoints at steps {sorted(steps)} but none of the "
                    f"critic's in {self.critic.cfg.directory} (it has {sorted(critic_steps)}); "
                    "cannot resume PPO (start a new run_dir)")
            steps &= critic_steps  # a crash between the two writes leaves one series ahead
        if not steps:
            return None
        step = max(steps)
        restored = self.policy.restore(trainer.state, step=step)
        trainer.state = restored.state
        if self.critic is not None:
            trainer.critic.state = self.critic.restore(trainer.critic.state, step=step).state
        data = dict(restored.data_state or {})
        if CURSOR_KEY in data:
            saved = data.pop(CURSOR_KEY)
            cursor = GroupCursor.from_dict(saved)
            if BY_PROCESS_KEY in saved:
                cursor = process_cursor(saved[BY_PROCESS_KEY], saved[NEXT_BY_PROCESS_KEY])
        else:  # written before the cursor existed: every group below it was trained
            cursor = GroupCursor((), int(data.pop(LEGACY_CONSUMED_KEY, 0)))
        return Resumed(step, cursor, data)

    def should_save(self, step: int) -> bool:
        return self.policy.should_save(step)

    def save(self, step: int, trainer: PolicyTrainer, cursor: GroupCursor, *,
             data: dict[str, Any] | None = None, force: bool = False) -> None:
        """Save after learner step `step` if it is due (or `force`)."""
        saved = cursor.to_dict()
        if jax.process_count() > 1:  # every process's pending ids and next id
            by_process = distributed.gather_int_lists(cursor.pending)
            nexts = [ids[0] for ids in distributed.gather_int_lists([cursor.next])]
            saved = {"pending": sorted(g for ids in by_process for g in ids), "next": max(nexts),
                     BY_PROCESS_KEY: by_process, NEXT_BY_PROCESS_KEY: nexts}
        state = {**(data or {}), CURSOR_KEY: saved}
        self.policy.save(step, trainer.state, data_state=state, force=force)
        if self.critic is not None:
            self.critic.save(step, trainer.critic.state, data_state=state, force=force)

    def wait(self) -> None:
        """Until every checkpoint written so far is on disk."""
        for ckpt in (self.policy, self.critic):
            if ckpt is not None:
                ckpt.wait()

    def close(self) -> None:
        for ckpt in (self.policy, self.critic):
            if ckpt is not None:
                ckpt.wait()
                ckpt.close()


def process_cursor(pending: list[list[int]], nexts: list[int]) -> GroupCursor:
    """This process's part of a checkpoint written by several: its own pending ids and next id
    when the run has as many processes as the one that wrote it; otherwise every process takes
    every n-th of all pending ids and continues past the highest id any process drew."""
    processes, rank = jax.process_count(), jax.process_index()
    if len(pending) == processes:
        return GroupCursor(tuple(pending[rank]), int(nexts[rank]))
    every = sorted(g for ids in pending for g in ids)
    return GroupCursor(tuple(every[rank::processes]), max(nexts))


def resumed_group_ids(cursor: GroupCursor, groups_per_step: int) -> Iterator[int]:
    """This process's group ids from `cursor` (a fresh run's: from 0): the groups it had drawn
    but not trained, regenerated first, then its own share of each step's ids
    (`process_group_ids`) from its next id on, as the uninterrupted run would have drawn them."""
    ids = process_group_ids(groups_per_step, jax.process_count(), jax.process_index(),
                            first_step=cursor.next // groups_per_step)
    return cursor.group_ids(g for g in ids if g >= cursor.next)


class TerminationGuard:
    """While active (a `with` block on the main thread), SIGTERM only sets `requested`: the
    learner's step hook then checkpoints and raises `RunStopped`. A second SIGTERM, or one
    outside the block, acts as usual."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # asked twice: stop now
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
            return
        self.requested = True

    def __enter__(self) -> TerminationGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


__all__ = ["LearnerCheckpoints", "Resumed", "RunStopped", "TerminationGuard"]
