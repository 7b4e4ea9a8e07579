"""The learners of agentic RL: `StreamingLearner` (asynchronous, bounded staleness) and the
`SyncLearner` baseline, both built from the orchestrator, the group queue and `PolicyTrainer`.

    learner = StreamingLearner(trainer, engine, make_interaction,
                               StreamingLearnerConfig(groups_per_step=4, max_staleness=1))
    records = await learner.run(num_steps=100)

**Streaming.** Rollouts never stop: up to `max_concurrency` episodes stay in flight while the
learner trains in a worker thread and, every `sync_every` steps, pushes its weights into the
engine without draining it. Versions count learner steps; a trajectory trained at step k has
staleness k - (its oldest token's version). Staleness is bounded by admission, not by
discarding: `StalenessGate` starts a group only if it can still be trained within
`max_staleness` versions (AReaL's rule, outstanding + 1 <= (v + max_staleness + 1 - K) * B),
and the learner takes ready groups in completion order as long as every deadline stays
reachable. The remaining lag is corrected by the algorithm's `policy_loss.off_policy`. At
max_staleness = 0 it takes exactly the synchronous learner's steps.

**Sync.** Start the step's groups, wait for all of them (replacing groups the queue dropped),
train, push the weights, repeat.

Group estimators get their advantages in the group queue, PPO's from its critic inside
`PolicyTrainer.train`; KL as a reward penalty is applied in the learner step. Under
`jax.distributed` every process runs a learner on its share of each step's groups and steps
together on the global batch. docs/concepts.md, docs/agentic.md and docs/scaling.md explain
each part.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from nonstop import perf
from nonstop.agentic.config import StreamingLearnerConfig
from nonstop.agentic.group_queue import GroupQueue, ScoredGroup, advantages_of
from nonstop.agentic.orchestrator import InteractionFactory, RolloutOrchestrator
from nonstop.engine import RolloutEngine
from nonstop.rl.policy_trainer import PolicyTrainer
from nonstop.rl.trajectory import Trajectory
from nonstop.train import distributed


def process_group_ids(groups_per_step: int, processes: int, rank: int, *, first_step: int = 0
                      ) -> Iterator[int]:
    """Process `rank`'s group ids: its contiguous block of each step's `groups_per_step` ids,
    from step `first_step`'s block on."""
    share = groups_per_step // processes
    for step in itertools.count(first_step):
        start = step * groups_per_step + rank * share
        yield from range(start, start + share)


@dataclasses.dataclass(frozen=True)
class GroupCursor:
    """Where a learner stands in its group ids, for checkpoints: `pending` were drawn but
    neither trained nor dropped (in flight, or ready and untaken: a resumed run regenerates
    them first, from their prompts and seeds), `next` is one past the highest id drawn."""

    pending: tuple[int, ...] = ()
    next: int = 0

    def group_ids(self, continuation: Iterator[int] | None = None) -> Iterator[int]:
        """The resumed run's ids: `pending`, then `continuation` (default next, next + 1, ...)."""
        return itertools.chain(self.pending, continuation if continuation is not None
                               else itertools.count(self.next))

    def to_dict(self) -> dict[str, Any]:
        return {"pending": list(self.pending), "next": self.next}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroupCursor:
        return cls(tuple(int(g) for g in data.get("pending", ())), int(data["next"]))


class StalenessGate:
    """Admission control and deadlines for bounded staleness (see the module docstring)."""

    def __init__(self, *, groups_per_step: int, max_staleness: int, version: int) -> None:
        self.B, self.s = groups_per_step, max_staleness
        self.version = version  # the version the engine samples new requests with
        self.steps = version  # K: the version the next learner step trains
        self.deadlines: dict[int, int] = {}  # outstanding group id -> deadline, admission order
        self.admitted_at: dict[int, int] = {}
        self._changed = asyncio.Event()

    def admissible(self) -> bool:
        return len(self.deadlines) + 1 <= (self.version + self.s + 1 - self.steps) * self.B

    async def admit(self, group_id: int) -> None:
        while not self.admissible():
            event = self._changed
            await event.wait()
        self.deadlines[group_id] = self.version + self.s
        self.admitted_at[group_id] = self.version

    def need(self, exclude: Iterable[int] = ()) -> int:
        """How many of the outstanding groups not in `exclude` the current step must still take
        so that every deadline stays reachable: max over k >= K of #(deadline <= k) - (k - K) B.
        Taking the `need` oldest always suffices; any choice that keeps it within the slots
        left is as good."""
        excluded = set(exclude)
        deadlines = [d for gid, d in self.deadlines.items() if gid not in excluded]
        need = 0
        for i, deadline in enumerate(deadlines):  # deadlines grow with admission order
            if i + 1 == len(deadlines) or deadlines[i + 1] != deadline:
                need = max(need, i + 1 - (max(deadline, self.steps) - self.steps) * self.B)
        return need

    def can_take(self, group_id: int, chosen: Iterable[int], slots_left: int) -> bool:
        """Whether the step may take `group_id` now and still meet every deadline."""
        return self.need([*chosen, group_id]) <= slots_left - 1

    def release(self, group_id: int, reason: str = "") -> None:
        """A group that will never be trained (dropped by the queue)."""
        self.deadlines.pop(group_id, None)
        self.admitted_at.pop(group_id, None)
        self._notify()

    def trained(self, group_ids: Iterable[int]) -> None:
        for gid in group_ids:
            self.deadlines.pop(gid, None)
            self.admitted_at.pop(gid, None)
        self.steps += 1
        self._notify()

    def published(self, version: int) -> None:
        self.version = version
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class NoSamplesError(RuntimeError):
    """A step's episodes all ended before the policy sampled a token: nothing to train on."""


class NoVarianceError(RuntimeError):
    """The queue dropped more groups (flat rewards, failed episodes) while one step collected
    its groups than `StreamingLearnerConfig.max_dropped_groups_per_step` allows."""


class EpisodesFailingError(RuntimeError):
    """More groups in a row than `StreamingLearnerConfig.max_failed_groups_in_a_row` had a
    failed episode: the engine, the environment or the reward fails every episode."""


def no_samples_cause(step: int, trajectories: list[Trajectory]) -> str:
    """Why a step has nothing to train on: its episodes' outcomes and prompt lengths."""
    outcomes = collections.Counter(str(t.info.get("status", "unknown")) for t in trajectories)
    prompts = [t.prompt_length for t in trajectories]
    said = ", ".join(f"{status} x{n}" for status, n in outcomes.most_common())
    return (f"step {step}: none of its {len(trajectories)} episodes sampled a token (outcomes: "
            f"{said}; prompts of {min(prompts)}-{max(prompts)} tokens). An episode that ends "
            "context_full before sampling has a prompt that fills the engine's context: raise "
            "engine.max_len (or agent.max_context_tokens), or shorten the prompt")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One learner step: which groups, what the trainer reported, how stale, where time went."""

    version: int  # the policy version trained (k)
    group_ids: tuple[int, ...]
    metrics: dict[str, float]
    staleness: tuple[int, ...]  # per episode that sampled: version - its oldest token's version
    reward_mean: float
    data_wait_s: float
    train_s: float
    sync_s: float
    published: int | None  # the version pushed to the engine after this step, if any
    completion_tokens: float = 0.0  # mean tokens sampled per episode
    # This process's episodes of the step: how each ended (Agent's status: done, max_turns,
    # context_full, ...) and the share solved (reward >= SOLVED_REWARD).
    outcomes: dict[str, int] = dataclasses.field(default_factory=dict)
    solved: float = 0.0


StepHook = Callable[[StepRecord], Awaitable[None]]
SOLVED_REWARD = 1.0  # an episode scoring at least this solved its task (built-in envs score 0/1)


class _Learner:
    def __init__(self, trainer: PolicyTrainer, engine: RolloutEngine, make_interaction:
                 InteractionFactory, config: StreamingLearnerConfig | None = None, *,
                 on_step: StepHook | None = None) -> None:
        """`on_step(record)` is awaited after each step (its weights pushed, if due), before the
        next step collects: evaluation, metrics and checkpoints go there."""
        self.trainer = trainer
        self.on_step = on_step
        self._drops_seen = 0
        self.engine = engine
        self.make_interaction = make_interaction
        config = config or StreamingLearnerConfig()
        self.processes, self.rank = jax.process_count(), jax.process_index()
        if config.groups_per_step % self.processes:
            raise ValueError(f"StreamingLearnerConfig.groups_per_step={config.groups_per_step} must be "
                             f"a multiple of the {self.processes} processes (each rolls out an "
                             "equal share of every step's groups)")
        self.global_config = config
        # This process's share of each step: the config every local part (gate, queue) uses.
        capacity = config.queue_capacity
        self.config = dataclasses.replace(
            config, groups_per_step=config.groups_per_step // self.processes,
            queue_capacity=None if capacity is None else -(-capacity // self.processes),
            max_dropped_groups_per_step=None if config.max_dropped_groups_per_step is None
            else -(-config.max_dropped_groups_per_step // self.processes))
        self.version = engine.policy_version
        self._base = self.version  # version at the start of run(): sync_every counts from it
        self.records: list[StepRecord] = []
        self.queue: GroupQueue | None = None
        self.orchestrator: RolloutOrchestrator | None = None
        self._unsettled: dict[int, None] = {}  # drawn ids not yet trained or dropped, in order
        self._next_id = 0

    @property
    def cursor(self) -> GroupCursor:
        """The group ids to resume from (see `GroupCursor`); exact between steps."""
        return GroupCursor(tuple(sorted(self._unsettled)), self._next_id)

    def _settle(self, group_ids: Iterable[int]) -> None:
        for gid in group_ids:
            self._unsettled.pop(gid, None)

    def _new_queue(self, on_drop: Callable[[int, str], None] | None = None) -> GroupQueue:
        return GroupQueue(self.config.queue_config(self.trainer.algorithm), on_drop=on_drop)

    async def _train(self, groups: list[ScoredGroup], data_wait_s: float) -> StepRecord:
        groups = sorted(groups, key=lambda g: g.group_id)
        trajectories = [t for g in groups for t in g.trajectories]
        k = self.version
        sampled = [t for t in trajectories if t.loss_mask.any()]
        if not sampled and self.processes == 1:  # (several: the others' steps may have data)
            raise NoSamplesError(no_samples_cause(k, trajectories))
        staleness = tuple(k - t.min_version for t in sampled)
        for t, lag in zip(sampled, staleness, strict=True):
            perf.gauge(perf.TRAIN_STALENESS, lag, episode=t.episode_id, step=k)
        t0 = time.perf_counter()
        kl_sum = 0.0
        # KL as a reward penalty for group estimators (PPO's critic takes it per token instead).
        penalise = self.trainer.kl_in_reward and not self.trainer.uses_gae
        if penalise:
            kl_sum = await asyncio.to_thread(self._penalise_kl, groups)
        metrics = await asyncio.to_thread(self.trainer.train, trajectories)
        totals = [sum(t.reward for t in trajectories), len(trajectories), kl_sum,
                  sum(t.num_sampled for t in trajectories)]
        if self.processes > 1:  # a collective: off the event loop
            totals = await asyncio.to_thread(distributed.sum_over_processes, totals)
        reward_sum, count, kl_sum, token_sum = totals
        if penalise:
            metrics = {**metrics, "kl_penalty": float(kl_sum / max(count, 1))}
        train_s = time.perf_counter() - t0
        self.version += 1
        published, sync_s = None, 0.0
        if (self.version - self._base) % self.config.sync_every == 0:
            t1 = time.perf_counter()
            with perf.span(perf.TRAIN_WEIGHT_SYNC, policy_version=self.version):
                await asyncio.to_thread(self._push, self.version)
            sync_s, published = time.perf_counter() - t1, self.version
        record = StepRecord(version=k, group_ids=tuple(g.group_id for g in groups),
                            metrics=metrics, staleness=staleness,
                            reward_mean=float(reward_sum / max(count, 1)),
                            data_wait_s=data_wait_s, train_s=train_s, sync_s=sync_s,
                            published=published,
                            completion_tokens=float(token_sum / max(count, 1)),
                            outcomes=dict(collections.Counter(
                                str(t.info.get("status", "done")) for t in trajectories)),
                            solved=float(np.mean([(t.reward or 0.0) >= SOLVED_REWARD
                                                  for t in trajectories]))
                            if trajectories else 0.0)
        self.records.append(record)
        self._settle(record.group_ids)
        return record

    def _penalise_kl(self, groups: list[ScoredGroup]) -> float:
        """KL as a reward penalty for a group estimator: each episode's summed KL to the
        reference (a collective with several processes) times the coefficient, taken off its
        reward before its group's advantages are recomputed. Returns the penalties' sum."""
        trajectories = [t for g in groups for t in g.trajectories]
        coef = self.trainer.algorithm.kl.coef
        penalties = coef * self.trainer.sequence_kl(trajectories)
        start = 0
        for g in groups:
            penalty = penalties[start:start + len(g.trajectories)]
            start += len(g.trajectories)
            advantages = advantages_of(g.rewards - penalty, self.queue.config)
            for t, p, a in zip(g.trajectories, penalty, advantages, strict=True):
                t.info["kl_penalty"], t.advantage = float(p), float(a)
        return float(np.sum(penalties))

    def _push(self, version: int) -> None:
        params = self.trainer.policy_params()
        if self.processes > 1:  # the trainer's arrays span every host; the engine is local
            params = distributed.fetch(params)
        self.engine.update_weights(params, version)
        # Rollout servers the processes share take the weights from process 0: none samples
        # before they have.
        distributed.barrier(f"weights {version} published")

    def _group_ids(self, group_ids: Iterable[int] | None) -> Iterator[int]:
        ids = iter(group_ids) if group_ids is not None else process_group_ids(
            self.global_config.groups_per_step, self.processes, self.rank)
        for gid in ids:  # recorded as drawn before anyone starts it
            self._unsettled[gid] = None
            self._next_id = max(self._next_id, gid + 1)
            yield gid

    def _start_run(self) -> None:
        self._base = self.version
        self._drops_seen = 0

    def _check_drops(self, queue: GroupQueue, collected: int) -> None:
        """Stop if this step's collection saw more drops than `max_dropped_groups_per_step`."""
        in_a_row = self.config.max_failed_groups_in_a_row
        if in_a_row is not None and queue.failed_in_a_row >= in_a_row:
            raise EpisodesFailingError(
                f"step {self.version}: the last {queue.failed_in_a_row} groups each had a failed "
                f"episode (max_failed_groups_in_a_row={in_a_row}); the latest error: "
                f"{queue.last_error}. Fix its cause (a dead rollout engine or server, a tool or "
                "reward that always raises) and resume the run")
        bound = self.config.max_dropped_groups_per_step
        dropped = sum(queue.dropped.values()) - self._drops_seen
        if bound is not None and dropped > bound:
            reasons = ", ".join(f"{r} x{n}" for r, n in queue.dropped.most_common())
            raise NoVarianceError(
                f"step {self.version}: the group queue dropped {dropped} groups while the step "
                f"collected {collected} of its {self.config.groups_per_step} (over the run: "
                f"{reasons}), more than max_dropped_groups_per_step={bound}. Flat groups carry "
                "no gradient: raise the bound, the group size or the sampling temperature; "
                "failed episodes: see their errors")

    async def _end_step(self, record: StepRecord) -> None:
        if self.queue is not None:
            self._drops_seen = sum(self.queue.dropped.values())
        if self.on_step is not None:
            await self.on_step(record)


class StreamingLearner(_Learner):
    """Trains as soon as a step's groups are available; see the module docstring."""

    async def run(self, num_steps: int, group_ids: Iterable[int] | None = None
                  ) -> list[StepRecord]:
        """Take `num_steps` learner steps on groups drawn from `group_ids` (default 0, 1, ...;
        with several processes, this process's share: `process_group_ids`)."""
        self._start_run()
        cfg = self.config
        gate = StalenessGate(groups_per_step=cfg.groups_per_step,
                             max_staleness=cfg.max_staleness, version=self.version)
        self.gate = gate
        def dropped(group_id: int, reason: str) -> None:
            self._settle([group_id])
            gate.release(group_id, reason)

        queue = self.queue = self._new_queue(on_drop=dropped)
        orchestrator = self.orchestrator = RolloutOrchestrator(
            self.engine, self.make_interaction, cfg.orchestrator, queue=queue, admission=gate)
        ids = self._group_ids(group_ids)
        producer = asyncio.create_task(orchestrator.run(ids), name="rollout-producer")
        out = []
        try:
            for _ in range(num_steps):
                t0 = time.perf_counter()
                with perf.span(perf.TRAIN_DATA_WAIT, step=self.version):
                    groups = await self._collect(queue, gate, producer)
                record = await self._train(groups, time.perf_counter() - t0)
                gate.trained(record.group_ids)
                out.append(record)
                # Before the new version admits groups: at max_staleness 0 the hook (evaluation,
                # checkpoints) sees the engine idle and no group of the next step started.
                await self._end_step(record)
                if record.published is not None:
                    gate.published(record.published)
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
            await orchestrator.close()
            queue.close()
        return out

    async def _collect(self, queue: GroupQueue, gate: StalenessGate,
                       producer: asyncio.Task[None]) -> list[ScoredGroup]:
        """The step's B groups, in completion order among those the deadlines allow."""
        chosen: dict[int, ScoredGroup] = {}
        B = self.config.groups_per_step
        while len(chosen) < B:
            changed = queue.next_change()  # before looking: no group made ready is missed
            left = B - len(chosen)
            pick = next((g for g in queue.ready_ids() if gate.can_take(g, chosen, left)), None)
            if pick is not None:
                chosen[pick] = queue.pop(pick)
                continue
            self._check_drops(queue, len(chosen))
            if producer.done():
                producer.result()  # re-raises a producer failure
                raise RuntimeError(f"the rollout ran out of groups after {len(self.records)} "
                                   f"steps ({len(chosen)} of {B} groups for the next one)")
            change = asyncio.ensure_future(changed.wait())
            await asyncio.wait({change, producer}, return_when=asyncio.FIRST_COMPLETED)
            change.cancel()
        return list(chosen.values())


class SyncLearner(_Learner):
    """The baseline: run the step's groups to the end, train, push the weights, repeat."""

    async def run(self, num_steps: int, group_ids: Iterable[int] | None = None
                  ) -> list[StepRecord]:
        self._start_run()
        cfg = self.config
        queue = self.queue = self._new_queue(on_drop=lambda gid, reason: self._settle([gid]))
        orchestrator = self.orchestrator = RolloutOrchestrator(
            self.engine, self.make_interaction, cfg.orchestrator, queue=queue)
        ids = self._group_ids(group_ids)
        B = cfg.groups_per_step
        out = []
        try:
            for _ in range(num_steps):
                t0 = time.perf_counter()
                kept: list[ScoredGroup] = []
                with perf.span(perf.TRAIN_DATA_WAIT, step=self.version):
                    while len(kept) < B:
                        self._check_drops(queue, len(kept))
                        batch = list(itertools.islice(ids, B - len(kept)))
                        if not batch:
                            raise RuntimeError("the rollout ran out of groups")
                        await orchestrator.run(batch)
                        ready = set(queue.ready_ids())
                        kept += [queue.pop(g) for g in batch if g in ready]
                record = await self._train(kept, time.perf_counter() - t0)
                out.append(record)
                await self._end_step(record)
        finally:
            await orchestrator.close()
            queue.close()
        return out
