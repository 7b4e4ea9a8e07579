"""RolloutOrchestrator on a real engine (tiny Qwen3, raw token ids) with fake tools of set latency:
episodes interleave, groups leave the moment they complete, the episodes of a group differ and
reruns reproduce, cancellation frees the engine, and a full queue holds 1,000 episodes back."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from nonstop import perf
from nonstop.agentic.config import AgentConfig, GroupQueueConfig, OrchestratorConfig
from nonstop.agentic.group_queue import GroupQueue
from nonstop.agentic.orchestrator import EpisodeSpec, LoopLagMonitor, RolloutOrchestrator
from nonstop.agentic.trajectory_builder import ScriptedToolInteraction
from nonstop.engine import Engine, EngineConfig
from nonstop.models import ModelConfig, init_decoder
from nonstop.rl.trajectory import Trajectory

TURN = 8
AGENT = AgentConfig(max_turns=4, max_tokens_per_turn=TURN, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    model = init_decoder(ModelConfig.tiny("qwen3"), seed=11)
    with Engine(model, EngineConfig(max_slots=7, max_len=64, prefill_chunks=(8, 32))) as e:
        yield e


def _factory(latency_s, turns=3):
    """Episodes with `turns` turns whose tool sleeps `latency_s(spec, turn)` seconds."""

    def make(spec: EpisodeSpec) -> ScriptedToolInteraction:
        async def tool(turn, sampled):
            await asyncio.sleep(latency_s(spec, turn))
            return [3, 4, 5, 6]

        prompt = [20 + spec.group_id % 200, 21, 22, 23, 24, 25, 26, 27]
        return ScriptedToolInteraction(prompt, num_turns=turns, tool=tool,
                                       reward_fn=lambda answer: float(np.mean(answer) < 128))

    return make


def _config(group_size, concurrency, seed=0):
    return OrchestratorConfig(group_size=group_size, max_concurrency=concurrency, seed=seed,
                              agent=AGENT)


def test_while_one_episode_waits_on_a_tool_the_engine_decodes_for_others(engine):
    latencies = {i: 0.05 + 0.08 * i for i in range(6)}
    orchestrator = RolloutOrchestrator(
        engine, _factory(lambda spec, turn: latencies[spec.episode_id]), _config(3, 6))

    async def main():
        with perf.span("test/window") as window:
            t0 = time.perf_counter()
            groups = await orchestrator.run_groups([0, 1])
            wall = time.perf_counter() - t0
        return groups, wall, window.id

    groups, wall, window_id = asyncio.run(main())
    events = perf.current().events()
    window = next(e for e in events if e.id == window_id)
    inside = [e for e in events if window.t0 <= e.t0 and e.t1 <= window.t1]
    tool_waits = [e for e in inside if e.name == perf.ROLLOUT_TOOL_WAIT]
    decodes = [e for e in inside if e.name == perf.ROLLOUT_DECODE]
    assert len(tool_waits) == 6 * 2 and all(len(g) == 3 for g in groups.values())
    # An episode in a tool wait has nothing in the engine: decode steps inside its wait are
    # for the other episodes. The longest waits (0.45 s) overlap the others' turns.
    longest = sorted(tool_waits, key=lambda e: e.duration_ns)[-4:]
    for wait in longest:
        assert sum(wait.t0 <= d.t0 and d.t1 <= wait.t1 for d in decodes) >= TURN
    # Serially the tools alone would take 2 x sum(latencies) = 2.4 s.
    assert wall < 0.6 * 2 * sum(latencies.values())


async def _warm_up_scoring(queue):
    """Compile the queue's advantage function (once per process) with a throwaway group."""
    warm = GroupQueue(queue.config)
    for i in range(queue.config.group_size):
        t = Trajectory.from_completion([1], [2], [-1.0], [0], group_id=-1, episode_id=i)
        t.reward = float(i)
        await warm.put(t)


def test_groups_leave_the_moment_they_complete(engine):
    # Group 0 starts first but its tools take 0.6 s; group 1's take none.
    slow = _factory(lambda spec, turn: 0.6 if spec.group_id == 0 else 0.0)
    queue = GroupQueue(GroupQueueConfig(group_size=2, capacity=4))
    orchestrator = RolloutOrchestrator(engine, slow, _config(2, 8), queue=queue)

    async def main():
        await _warm_up_scoring(queue)
        producer = asyncio.create_task(orchestrator.run([0, 1]))
        first = await queue.get()
        running_then = orchestrator.in_flight
        second = await queue.get()
        await producer
        return first, second, running_then

    first, second, running_then = asyncio.run(main())
    assert (first.group_id, second.group_id) == (1, 0)
    assert running_then == 2  # group 0's episodes were still running when group 1 came out
    assert first.completed_at < min(t.info["finished_at"] for t in second.trajectories)


def test_the_episodes_of_a_group_differ_and_a_rerun_reproduces_them(engine):
    def run(seed):
        orchestrator = RolloutOrchestrator(engine, _factory(lambda s, t: 0.0, turns=2),
                                           _config(4, 8, seed=seed))
        groups = asyncio.run(orchestrator.run_groups([0, 1]))
        return [t.tokens[t.loss_mask] for g in (0, 1) for t in groups[g]]

    a, b, c = run(0), run(0), run(1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert len({x.tobytes() for x in a}) == 8  # eight different episodes
    assert not any(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_close_cancels_episodes_and_frees_the_engine(engine):
    queue = GroupQueue(GroupQueueConfig(group_size=2))
    orchestrator = RolloutOrchestrator(engine, _factory(lambda s, t: 5.0), _config(2, 6),
                                       queue=queue)

    async def main():
        producer = asyncio.create_task(orchestrator.run(range(10)))
        while orchestrator.started < 6:
            await asyncio.sleep(0.005)
        await orchestrator.close()
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await asyncio.sleep(0.05)  # let the scheduler thread handle the cancellations

    asyncio.run(main())
    assert orchestrator.started == 6 and orchestrator.finished == 0
    assert orchestrator.in_flight == 0
    stats = engine.stats()
    assert stats.active_slots == 0 and stats.waiting == 0


def test_a_full_queue_holds_back_1000_episodes(engine):
    groups, size, capacity, concurrency = 250, 4, 3, 16
    one_token = AgentConfig(max_turns=1, max_tokens_per_turn=1, ignore_eos=True)
    config = OrchestratorConfig(group_size=size, max_concurrency=concurrency, agent=one_token)
    queue = GroupQueue(GroupQueueConfig(group_size=size, capacity=capacity))
    orchestrator = RolloutOrchestrator(engine, _factory(lambda s, t: 0.0, turns=1), config,
                                       queue=queue)

    async def main():
        producer = asyncio.create_task(orchestrator.run(range(groups)))

        def stalled():
            s = engine.stats()
            return (orchestrator.in_flight == concurrency and queue.num_ready == capacity
                    and s.waiting == 0 and s.active_slots == 0)

        while not stalled():
            await asyncio.sleep(0.005)
        # Every slot is held by an episode waiting to hand in the last member of its group.
        snapshot = orchestrator.started, queue.num_pending_episodes
        got = [(await queue.get()).group_id for _ in range(groups)]
        await producer
        return snapshot, got

    (started, pending), got = asyncio.run(main())
    assert started <= capacity * size + concurrency * size + size  # 80, not 1,000
    assert pending <= concurrency * (size - 1) + size
    assert sorted(got) == list(range(groups)) and not queue.dropped
    assert queue.max_ready == capacity and orchestrator.max_in_flight == concurrency
    assert orchestrator.started == orchestrator.finished == groups * size


def test_loop_lag_monitor_sees_a_blocked_loop():
    async def main():
        async with LoopLagMonitor(interval_s=0.002) as monitor:
            await asyncio.sleep(0.02)
            time.sleep(0.08)  # blocks the loop, as synchronous work in a coroutine would
            await asyncio.sleep(0.02)
        return monitor

    monitor = asyncio.run(main())
    assert monitor.quantile(1.0) >= 60 and monitor.quantile(0.5) < 60
