"""GroupQueue on hand-built trajectories: scoring by hand-computed GRPO/Dr.GRPO/RLOO advantages,
release in completion order, drops counted by reason, a bounded queue that makes `put` wait, and
an event loop that keeps running while groups are scored."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from nonstop.agentic.config import GroupQueueConfig, StreamingLearnerConfig
from nonstop.agentic.group_queue import GroupQueue, QueueClosed
from nonstop.models.validation import ConfigError
from nonstop.rl import RLAlgorithmConfig
from nonstop.rl.config import OverlongConfig
from nonstop.rl.trajectory import Trajectory


def _episode(group_id: int, index: int, reward: float, status: str = "done") -> Trajectory:
    t = Trajectory.from_completion([1, 2], [3, 4, 5], [-0.5] * 3, [0] * 3, group_id=group_id,
                                   episode_id=group_id * 4 + index)
    t.reward = reward
    t.info["status"] = status
    return t


def _run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("estimator,expected", [
    # rewards 1, 0, 0, 1: mean 0.5; Bessel std sqrt(1/3); RLOO scales by G/(G-1) = 4/3.
    ("grpo", [0.5 / math.sqrt(1 / 3), -0.5 / math.sqrt(1 / 3)]),
    ("dr_grpo", [0.5, -0.5]),
    ("rloo", [2 / 3, -2 / 3]),
])
def test_a_complete_group_gets_its_advantages(estimator, expected):
    async def main():
        queue = GroupQueue(GroupQueueConfig(group_size=4, advantage=estimator))
        for i, r in [(3, 1.0), (1, 0.0), (0, 1.0)]:
            await queue.put(_episode(7, i, r))
        assert queue.num_ready == 0 and queue.num_pending_episodes == 3
        await queue.put(_episode(7, 2, 0.0))
        return await queue.get()

    group = _run(main())
    assert group.group_id == 7
    assert [t.episode_id for t in group.trajectories] == [28, 29, 30, 31]  # episode order
    hi, lo = expected
    np.testing.assert_allclose(group.advantages, [hi, lo, lo, hi], rtol=1e-5)
    assert [t.advantage for t in group.trajectories] == pytest.approx([hi, lo, lo, hi], rel=1e-5)


def test_groups_leave_in_completion_order_and_drops_are_counted():
    dropped = []

    async def main():
        cfg = GroupQueueConfig(group_size=2, dynamic_sampling=True)
        queue = GroupQueue(cfg, on_drop=lambda g, why: dropped.append((g, why)))
        await queue.put(_episode(0, 0, 1.0))  # group 0 starts first ...
        for g, rewards in [(1, (0.0, 1.0)), (2, (1.0, 1.0))]:
            for i, r in enumerate(rewards):
                await queue.put(_episode(g, i, r))
        await queue.put(_episode(3, 0, 0.0))
        await queue.put(_episode(3, 1, 1.0, status="error"))
        await queue.put(_episode(0, 1, 0.0))  # ... and completes last
        return queue, [(await queue.get()).group_id for _ in range(2)]

    queue, order = _run(main())
    assert order == [1, 0]
    assert dict(queue.dropped) == {"no_reward_variance": 1, "episode_failed": 1}
    assert dropped == [(2, "no_reward_variance"), (3, "episode_failed")]
    assert queue.completed == queue.delivered == 2


def test_a_full_queue_makes_the_producer_wait_and_never_drops():
    async def main():
        queue = GroupQueue(GroupQueueConfig(group_size=2, capacity=2))
        produced = []

        async def producer():
            for g in range(6):
                await queue.put(_episode(g, 0, 0.0))
                await queue.put(_episode(g, 1, 1.0))  # completes group g: waits when full
                produced.append(g)

        task = asyncio.create_task(producer())
        while not (produced == [0, 1] and queue.num_ready == 2
                   and queue.num_pending_episodes == 0):
            await asyncio.sleep(0.001)
        # Full: group 2 is complete but its put waits; nothing more is produced meanwhile.
        await asyncio.sleep(0.05)
        assert produced == [0, 1] and queue.num_ready == 2 and not task.done()
        got = [(await queue.get()).group_id for _ in range(6)]
        await task
        return queue, got

    queue, got = _run(main())
    assert got == list(range(6)) and queue.max_ready == 2 and queue.put_wait_s > 0
    assert not queue.dropped


def test_waiting_for_a_group_that_was_dropped_returns_none_and_close_wakes_waiters():
    async def main():
        queue = GroupQueue(GroupQueueConfig(group_size=1, dynamic_sampling=True))
        waiter = asyncio.create_task(queue.wait_for(5))
        await asyncio.sleep(0)
        await queue.put(_episode(5, 0, 1.0))  # one reward: no variance, dropped
        assert await waiter is None
        getter = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        queue.close()
        with pytest.raises(QueueClosed):
            await getter

    _run(main())


def test_scoring_does_not_block_the_event_loop():
    async def main():
        queue = GroupQueue(GroupQueueConfig(group_size=3))
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        for g in range(5):
            for i in range(3):
                await queue.put(_episode(g, i, float(i)))
        task.cancel()
        return ticks

    # Advantages run in a worker thread: the loop keeps ticking while each group is scored.
    assert _run(main()) >= 5


def test_configs_name_the_bad_field():
    with pytest.raises(ConfigError, match="GroupQueueConfig.advantage='gae' is invalid"):
        GroupQueueConfig(advantage="gae")
    with pytest.raises(ConfigError, match=r"StreamingLearnerConfig.sync_every=3 .*max_staleness \+ 1 = 2"):
        StreamingLearnerConfig(max_staleness=1, sync_every=3)
    with pytest.raises(ConfigError, match="queue_capacity=5 .* = 8"):
        StreamingLearnerConfig(groups_per_step=4, max_staleness=1, queue_capacity=5)
    cfg = StreamingLearnerConfig(groups_per_step=3, max_staleness=2).queue_config(RLAlgorithmConfig.dapo())
    assert cfg.capacity == 9 and cfg.dynamic_sampling and cfg.advantage == "grpo"
    assert cfg.overlong == RLAlgorithmConfig.dapo().overlong
    ppo = StreamingLearnerConfig().queue_config(RLAlgorithmConfig.ppo())
    assert ppo.advantage == "none" and ppo.overlong is None and not ppo.dynamic_sampling


def _sampled(group_id: int, index: int, reward: float, sampled: int) -> Trajectory:
    t = Trajectory.from_completion([1, 2], [3] * sampled, [-0.5] * sampled, [0] * sampled,
                                   group_id=group_id, episode_id=group_id * 4 + index)
    t.reward = reward
    t.info["status"] = "done"
    return t


def test_overlong_shaping_comes_before_advantages_and_dynamic_sampling():
    # DAPO's soft punishment with limit 10, buffer 4: none up to 6 sampled tokens, then -1/4
    # per token, -1 from 10 on.
    overlong = OverlongConfig(max_response_tokens=10, buffer_tokens=4, penalty=1.0)
    cfg = GroupQueueConfig(group_size=2, advantage="dr_grpo", dynamic_sampling=True,
                           overlong=overlong)

    async def main():
        queue = GroupQueue(cfg)
        # Group 0: equal raw rewards, but 4 vs 8 sampled tokens: shaped 1.0 and 0.5, so it has
        # variance after shaping and is kept.
        await queue.put(_sampled(0, 0, 1.0, 4))
        await queue.put(_sampled(0, 1, 1.0, 8))
        # Group 1: raw 1.0 and 0.0; 12 and 3 tokens: shaped 0.0 and 0.0, dropped as flat.
        await queue.put(_sampled(1, 0, 1.0, 12))
        await queue.put(_sampled(1, 1, 0.0, 3))
        return queue, await queue.get()

    queue, group = _run(main())
    assert group.group_id == 0 and queue.dropped == {"no_reward_variance": 1}
    np.testing.assert_allclose(group.rewards, [1.0, 0.5])
    np.testing.assert_allclose(group.advantages, [0.25, -0.25])  # Dr.GRPO: reward - mean
    assert [t.reward for t in group.trajectories] == [1.0, 0.5]
    assert [t.info["reward_before_overlong"] for t in group.trajectories] == [1.0, 1.0]


def test_ppo_groups_pass_through_without_group_advantages():
    async def main():
        queue = GroupQueue(GroupQueueConfig(group_size=1, advantage="none"))
        await queue.put(_sampled(5, 0, 0.75, 3))
        return await queue.get()

    group = _run(main())
    assert group.group_id == 5 and group.rewards.tolist() == [0.75]
    assert group.advantages.tolist() == [0.0] and group.trajectories[0].advantage == 0.0
