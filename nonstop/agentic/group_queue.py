"""`GroupQueue`: finished episodes in, scored groups out, the moment each group completes.

    queue = GroupQueue(GroupQueueConfig(group_size=4, capacity=8))
    await queue.put(trajectory)          # from each episode; waits while the queue is full
    group = await queue.get()            # the next complete group, in completion order

Episodes are held by `group_id` until `group_size` of them have arrived. The group is then
scored in a worker thread, so the event loop never blocks on it — DAPO's overlong punishment (if
configured) added to each reward, advantages computed by `nonstop.rl.episode_advantages` (none
for PPO, whose critic gives them per token in the trainer) — filtered (a group with a failed
episode is dropped; with dynamic sampling, so is a group whose shaped rewards are all equal)
and, if kept, made ready. Groups come out
in the order they completed, not the order they started: a short group started late does not
wait behind a long one.

Bounded, never silent: at most `capacity` ready groups are held; the `put` that completes a group
while the queue is full waits for room, so a producer that holds its concurrency slot until
`put` returns is slowed down, and memory stays bounded. Every dropped group is counted by reason
(`dropped`), reported through `on_drop`, and recorded as a perf counter.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from nonstop import perf
from nonstop.agentic.config import GroupQueueConfig
from nonstop.rl.advantages import episode_advantages, overlong_penalty
from nonstop.rl.trajectory import Trajectory

GROUPS_DROPPED = "rollout/groups_dropped"  # counter, tagged reason=...
_REMEMBERED_DROPS = 4096  # recent dropped group ids kept, so `wait_for` on one returns None


@functools.cache
def _advantage_fn(estimator: str, std_eps: float) -> Callable[..., jax.Array]:
    """`episode_advantages` for one group, jitted once per estimator (and group size)."""
    return jax.jit(functools.partial(episode_advantages, num_groups=1, estimator=estimator,
                                     std_eps=std_eps))


def advantages_of(values: np.ndarray, config: GroupQueueConfig) -> np.ndarray:
    """float32[G]: one group's advantages of its (shaped) rewards, by `config.advantage`."""
    if config.advantage == "none":
        return np.zeros(len(values), np.float32)
    fn = _advantage_fn(config.advantage, config.std_eps)
    return np.asarray(fn(np.asarray(values, np.float32), np.zeros(len(values), np.int32)),
                      np.float32)


class QueueClosed(RuntimeError):
    """The queue was closed while someone waited on it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoredGroup:
    """The G episodes of one prompt, in episode order, with rewards and advantages set."""

    group_id: int
    trajectories: tuple[Trajectory, ...]
    rewards: np.ndarray  # float32[G]
    advantages: np.ndarray  # float32[G]
    completed_at: float  # perf_counter() when its last episode arrived

    @property
    def min_version(self) -> int:
        return min(t.min_version for t in self.trajectories)


class GroupQueue:
    """Groups episodes by prompt, scores complete groups, and hands them on; see the module."""

    def __init__(self, config: GroupQueueConfig,
                 on_drop: Callable[[int, str], None] | None = None) -> None:
        self.config = config
        self.on_drop = on_drop
        self._pending: dict[int, list[Trajectory]] = {}
        self._ready: collections.OrderedDict[int, ScoredGroup] = collections.OrderedDict()
        self._recent_drops: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._changed = asyncio.Event()
        self._closed = False
        self.dropped: collections.Counter[str] = collections.Counter()
        self.completed = 0  # groups made ready
        self.delivered = 0  # groups handed to the consumer
        self.max_ready = 0  # the most ready groups ever held at once
        self.put_wait_s = 0.0  # producer time spent waiting for room
        self.failed_in_a_row = 0  # groups dropped for a failed episode since the last sound one
        self.last_error: str | None = None  # the latest failed episode's info["error"]

    # ---------------------------------------------------------------- producer side

    async def put(self, trajectory: Trajectory) -> None:
        """Add one finished episode; if it completes its group, score it and wait for room."""
        self._check_open()
        gid = trajectory.group_id
        members = self._pending.setdefault(gid, [])
        members.append(trajectory)
        if len(members) < self.config.group_size:
            return
        del self._pending[gid]
        members.sort(key=lambda t: t.episode_id)
        failed = [t for t in members if t.info.get("status") == "error"]
        if failed:
            self.failed_in_a_row += 1
            self.last_error = str(failed[-1].info.get("error", "no error recorded"))
            self._drop(gid, "episode_failed")
            return
        self.failed_in_a_row = 0
        rewards = np.asarray([t.reward for t in members], np.float32)
        lengths = np.asarray([t.num_sampled for t in members], np.float32)
        loop = asyncio.get_running_loop()
        rewards, advantages = await loop.run_in_executor(None, self._score, rewards, lengths)
        if self.config.dynamic_sampling and not np.ptp(rewards) > 0:
            self._drop(gid, "no_reward_variance")
            return
        for t, r, a in zip(members, rewards, advantages, strict=True):
            if self.config.overlong is not None:
                t.info["reward_before_overlong"] = t.reward
            t.reward, t.advantage = float(r), float(a)
        group = ScoredGroup(group_id=gid, trajectories=tuple(members), rewards=rewards,
                            advantages=advantages, completed_at=time.perf_counter())
        if len(self._ready) >= self.config.capacity:
            t0 = time.perf_counter()
            while len(self._ready) >= self.config.capacity:
                await self.wait_for_change()
            self.put_wait_s += time.perf_counter() - t0
        self._ready[gid] = group
        self.completed += 1
        self.max_ready = max(self.max_ready, len(self._ready))
        self._notify()

    def _score(self, rewards: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shaped rewards, advantages), float32[G] each."""
        if self.config.overlong is not None:
            rewards = rewards + np.asarray(overlong_penalty(lengths, self.config.overlong))
        return rewards, advantages_of(rewards, self.config)

    def _drop(self, group_id: int, reason: str) -> None:
        self.dropped[reason] += 1
        self._recent_drops[group_id] = reason
        if len(self._recent_drops) > _REMEMBERED_DROPS:
            self._recent_drops.popitem(last=False)
        perf.count(GROUPS_DROPPED, 1, reason=reason, group=group_id)
        if self.on_drop is not None:
            self.on_drop(group_id, reason)
        self._notify()

    # ---------------------------------------------------------------- consumer side

    async def get(self) -> ScoredGroup:
        """The oldest ready group (completion order); waits for one."""
        while not self._ready:
            await self.wait_for_change()
        _, group = self._ready.popitem(last=False)
        self._delivered()
        return group

    def pop(self, group_id: int) -> ScoredGroup:
        """A specific ready group (KeyError if it is not ready)."""
        group = self._ready.pop(group_id)
        self._delivered()
        return group

    async def wait_for(self, group_id: int) -> ScoredGroup | None:
        """That group once ready, or None if it was dropped."""
        while group_id not in self._ready:
            if group_id in self._recent_drops:
                return None
            await self.wait_for_change()
        return self.pop(group_id)

    def ready_ids(self) -> list[int]:
        """Ids of the ready groups, oldest first."""
        return list(self._ready)

    def next_change(self) -> asyncio.Event:
        """The event the next change sets. Take it before looking at the queue and wait on it
        after: a change in between (before a task started with `ensure_future` first runs) is
        then not missed."""
        return self._changed

    async def wait_for_change(self) -> None:
        """Until a group is made ready, taken or dropped (or the queue closes)."""
        self._check_open()
        event = self._changed
        await event.wait()
        self._check_open()

    def close(self) -> None:
        """Wake every waiter with `QueueClosed`."""
        self._closed = True
        self._notify()

    # ---------------------------------------------------------------- internals and views

    def _delivered(self) -> None:
        self.delivered += 1
        self._notify()

    def _notify(self) -> None:
        perf.gauge(perf.GROUP_QUEUE_DEPTH, len(self._ready))
        self._changed.set()
        self._changed = asyncio.Event()

    def _check_open(self) -> None:
        if self._closed:
            raise QueueClosed("the group queue is closed")

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    @property
    def num_pending_episodes(self) -> int:
        return sum(len(v) for v in self._pending.values())

    def pending_groups(self) -> Sequence[int]:
        return list(self._pending)
