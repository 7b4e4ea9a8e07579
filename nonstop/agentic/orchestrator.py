"""`RolloutOrchestrator`: many episodes in flight on one engine, on one asyncio event loop.

    orchestrator = RolloutOrchestrator(engine, make_interaction, OrchestratorConfig(...),
                                       queue=GroupQueue(...))
    await orchestrator.run(range(100))        # groups 0..99, G episodes each, into the queue
    groups = await orchestrator.run_groups([0, 1])   # or: run these groups and return them

Each group id becomes `group_size` episodes (`make_interaction(EpisodeSpec)` builds each one's
interaction; episode i of group g has the seed derived from (seed, g, i)). At most
`max_concurrency` episodes are in flight: while one awaits a tool, the engine decodes for the
others. An episode holds its concurrency slot until the queue has accepted its trajectory, so
a full queue stops new episodes from starting (backpressure) instead of piling up finished ones.

An optional `admission` (see `Admission`) is awaited before each group starts: the streaming
learner uses it to bound staleness. `close()` cancels every episode in flight; a cancelled
engine request frees its slot.

`LoopLagMonitor` measures how late the event loop wakes a sleeping task: the figure that shows
whether per-episode host work (parsing, tokenizing, scoring) is starving everyone else.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np

from nonstop import perf
from nonstop.agentic.agent import Agent, derive_seed
from nonstop.agentic.config import OrchestratorConfig
from nonstop.agentic.group_queue import GroupQueue
from nonstop.agentic.trajectory_builder import Interaction
from nonstop.engine import RolloutClient
from nonstop.rl.trajectory import Trajectory

LOOP_LAG = "rollout/loop_lag_ms"  # gauge: how late a sleeping task woke, in ms
IN_FLIGHT = "rollout/in_flight"  # gauge: episodes in flight


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeSpec:
    """Which episode to build: group (prompt) id, index within the group, ids and seed."""

    group_id: int
    index: int
    episode_id: int
    seed: int


InteractionFactory = Callable[[EpisodeSpec], Interaction]


class OrchestratorClosed(RuntimeError):
    """An episode was to start after `close()`."""


class Admission(Protocol):
    """Decides when a group may start (e.g. the streaming learner's staleness bound)."""

    async def admit(self, group_id: int) -> None: ...


class RolloutOrchestrator:
    """Runs groups of episodes concurrently; see the module docstring."""

    def __init__(self, engine: RolloutClient, make_interaction: InteractionFactory,
                 config: OrchestratorConfig | None = None, *, queue: GroupQueue | None = None,
                 admission: Admission | None = None) -> None:
        self.engine = engine
        self.config = config or OrchestratorConfig()
        self.make_interaction = make_interaction
        self.queue = queue
        self.admission = admission
        self.agent = Agent(engine, self.config.agent)
        self._slots = asyncio.Semaphore(self.config.max_concurrency)
        self._tasks: set[asyncio.Task[Trajectory]] = set()
        self._closed = False
        self.in_flight = 0
        self.max_in_flight = 0
        self.started = 0
        self.finished = 0
        self.status: collections.Counter[str] = collections.Counter()

    def spec(self, group_id: int, index: int) -> EpisodeSpec:
        g = self.config.group_size
        return EpisodeSpec(group_id=group_id, index=index, episode_id=group_id * g + index,
                           seed=derive_seed(self.config.seed, group_id, index))

    async def _episode(self, spec: EpisodeSpec, deliver: bool) -> Trajectory:
        """One episode, holding a concurrency slot until the queue accepted it."""
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        perf.gauge(IN_FLIGHT, self.in_flight)
        try:
            interaction = self.make_interaction(spec)
            trajectory = await self.agent.run_episode(
                interaction, group_id=spec.group_id, episode_id=spec.episode_id, seed=spec.seed)
            trajectory.info["group_index"] = spec.index
            self.finished += 1
            self.status[trajectory.info["status"]] += 1
            if deliver and self.queue is not None:
                await self.queue.put(trajectory)
            return trajectory
        finally:
            self.in_flight -= 1
            self._slots.release()

    async def _start(self, spec: EpisodeSpec, deliver: bool) -> asyncio.Task[Trajectory]:
        with perf.span(perf.ROLLOUT_QUEUE_WAIT, episode=spec.episode_id, group=spec.group_id):
            await self._slots.acquire()
        if self._closed:
            self._slots.release()
            raise OrchestratorClosed("the orchestrator is closed; no new episode starts")
        try:
            task = asyncio.create_task(self._episode(spec, deliver),
                                       name=f"episode-{spec.episode_id}")
        except BaseException:
            self._slots.release()
            raise
        self.started += 1
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run(self, group_ids: Iterable[int]) -> None:
        """Start every group (after `admission`, within `max_concurrency`) and deliver each
        finished episode to the queue; returns once all have been delivered."""
        if self.queue is None:
            raise ValueError("RolloutOrchestrator.run needs a queue; use run_groups without one")
        started: list[asyncio.Task[Trajectory]] = []
        try:
            for gid in group_ids:
                if self.admission is not None:
                    await self.admission.admit(gid)
                for i in range(self.config.group_size):
                    started.append(await self._start(self.spec(gid, i), deliver=True))
                for t in started:
                    if t.done():
                        t.result()  # an episode that raised (not one that failed) stops the run
                started = [t for t in started if not t.done()]
            if started:
                await asyncio.gather(*started)
        except BaseException:
            for t in started:
                t.cancel()
            raise

    async def run_groups(self, group_ids: Iterable[int]) -> dict[int, list[Trajectory]]:
        """Run these groups concurrently and return their episodes by group (in episode
        order), without a queue. Admission is not consulted."""
        tasks = [await self._start(self.spec(gid, i), deliver=False)
                 for gid in group_ids for i in range(self.config.group_size)]
        out: dict[int, list[Trajectory]] = {}
        for t in await asyncio.gather(*tasks):
            out.setdefault(t.group_id, []).append(t)
        return out

    async def close(self) -> None:
        """Start no more episodes; cancel every one in flight and wait until they are gone."""
        self._closed = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class LoopLagMonitor:
    """Samples event-loop lag: sleep `interval_s`, record how much later than asked it woke."""

    def __init__(self, interval_s: float = 0.005, max_samples: int = 200_000) -> None:
        self.interval_s = interval_s
        self.samples_ms: collections.deque[float] = collections.deque(maxlen=max_samples)
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag_ms = (time.perf_counter() - t0 - self.interval_s) * 1e3
            self.samples_ms.append(max(lag_ms, 0.0))
            perf.gauge(LOOP_LAG, lag_ms)

    def start(self) -> LoopLagMonitor:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def quantile(self, q: float) -> float:
        """The q-quantile of the lag in ms (0.0 before any sample)."""
        return float(np.quantile(np.asarray(self.samples_ms), q)) if self.samples_ms else 0.0

    async def __aenter__(self) -> LoopLagMonitor:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
