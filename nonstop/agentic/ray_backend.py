"""Environments on Ray: episodes whose `reset`/`step`/`final_reward` run in Ray actors.

    pool = RayEnvironmentPool(functools.partial(CalculatorEnv, CalculatorConfig()),
                              RayEnvConfig(num_actors=4, max_concurrency=16))
    env = pool.environment()        # an `Environment`, used exactly like an in-process one
    obs = await env.reset(seed=7)   # runs on one of the pool's actors
    ...
    pool.shutdown()

The factory must pickle; each actor builds one environment per episode from it. An actor that
dies fails its episodes with `EnvironmentActorDied` and is replaced. Ray is imported only when a
pool is built (`pip install nonstop[ray]`). Placement, failures and cluster setup:
docs/scaling.md, "Environments on a Ray cluster".
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from nonstop import perf
from nonstop.agentic.environment import (
    AgentAction,
    Environment,
    Observation,
    Split,
    StepResult,
    Task,
    draw_task,
)
from nonstop.models.chat import Message
from nonstop.models.validation import check

EnvironmentFactory = Callable[[], Environment]
ACTOR_DEATHS = "rollout/env_actor_deaths"  # counter: environment actors found dead and replaced


def import_ray() -> Any:
    """The `ray` module, or an error saying how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ImportError(
            "environments on Ray need the `ray` package, which is not installed; install it with "
            "`pip install nonstop[ray]` (or set env.backend: local to run environments "
            "in-process)") from error
    return ray


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayEnvConfig:
    """Where and how environment actors run.

    address: the Ray cluster to join ("auto", "ray://host:10001", "host:6379"); None: the Ray
    already initialized in this process, else a new local one. num_actors: environment actors.
    max_concurrency: environment calls one actor runs at once. num_cpus_per_actor: CPUs Ray
    reserves for each actor (tool-heavy environments: 1 or more; mostly-waiting ones: a fraction).
    """

    address: str | None = None
    num_actors: int = 2
    max_concurrency: int = 16
    num_cpus_per_actor: float = 1.0

    def __post_init__(self) -> None:
        owner = "RayEnvConfig"
        check(self.address is None or bool(self.address.strip()), owner, "address", self.address,
              "None (a local Ray) or a cluster address such as 'auto' or 'ray://head:10001'")
        check(isinstance(self.num_actors, int) and self.num_actors >= 1, owner, "num_actors",
              self.num_actors, "an int >= 1")
        check(isinstance(self.max_concurrency, int) and self.max_concurrency >= 1, owner,
              "max_concurrency", self.max_concurrency, "an int >= 1")
        check(self.num_cpus_per_actor >= 0, owner, "num_cpus_per_actor",
              self.num_cpus_per_actor, "a number >= 0")


def init_ray(config: RayEnvConfig, **local_options: Any) -> bool:
    """Connect to `config.address`, or start a local Ray (with `local_options`, e.g.
    `num_cpus=2`) when no address is set; nothing if Ray is already initialized here.
    Returns whether this call initialized Ray (so the caller knows to shut it down)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    if config.address is not None:
        ray.init(address=config.address)  # the cluster's own settings (CPUs, dashboard) apply
    else:
        ray.init(include_dashboard=False, **local_options)
    return True


class EnvironmentActorDied(RuntimeError):
    """The Ray actor hosting an episode's environment died; the episode's state is lost."""


class _EnvironmentHost:
    """The actor: one environment per live episode, built by `factory`, kept by episode key."""

    def __init__(self, factory: EnvironmentFactory) -> None:
        self.factory = factory
        self.envs: dict[int, Environment] = {}
        self.active = 0
        self.max_active = 0
        self.calls = 0

    def _enter(self) -> None:
        self.calls += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)

    async def reset(self, key: int, task: Task | None, seed: int) -> Observation:
        self._enter()
        try:
            env = self.envs[key] = self.factory()
            return await env.reset(task, seed=seed)
        finally:
            self.active -= 1

    async def step(self, key: int, action: AgentAction) -> StepResult:
        self._enter()
        try:
            return await self.envs[key].step(action)
        finally:
            self.active -= 1

    async def final_reward(self, key: int) -> float:
        self._enter()
        try:
            return float(await self.envs[key].final_reward())
        finally:
            self.active -= 1

    async def close(self, key: int) -> None:
        env = self.envs.pop(key, None)
        if env is not None:
            env.close()

    async def stats(self) -> dict[str, int]:
        """Live episodes, calls so far, calls running now, and the most that ever ran at once."""
        return {"episodes": len(self.envs), "calls": self.calls, "active": self.active,
                "max_active": self.max_active}

    async def pid(self) -> int:
        import os

        return os.getpid()


class RayEnvironmentPool:
    """`num_actors` environment actors and the episodes placed on them; see the module docstring.

    Ray must be initialized first (`init_ray`). `shutdown()` (or leaving a `with` block) kills the
    actors."""

    def __init__(self, factory: EnvironmentFactory, config: RayEnvConfig | None = None) -> None:
        self.ray = import_ray()
        if not self.ray.is_initialized():
            raise RuntimeError("Ray is not initialized; call nonstop.agentic.ray_backend."
                               "init_ray(config) (or ray.init(...)) before building the pool")
        self.config = config or RayEnvConfig()
        self.factory = factory
        self.template = factory()  # in-process: sample_task, tool schemas, demonstrations
        self._actor_cls = self.ray.remote(_EnvironmentHost).options(
            max_concurrency=self.config.max_concurrency,
            num_cpus=self.config.num_cpus_per_actor)
        self.actors: list[Any] = [self._new_actor() for _ in range(self.config.num_actors)]
        self.live = [0] * self.config.num_actors  # episodes placed on each actor, not yet closed
        self.replaced = 0
        self._keys = itertools.count()
        self._closing: list[Any] = []  # refs of episode closes sent to actors, maybe not done
        self._closed = False

    def _new_actor(self) -> Any:
        return self._actor_cls.remote(self.factory)

    def environment(self) -> RayEnvironment:
        """A new episode's environment (it is placed on an actor at `reset`)."""
        if self._closed:
            raise RuntimeError("the RayEnvironmentPool is shut down; build a new one")
        return RayEnvironment(self)

    def _place(self) -> tuple[int, int, Any]:
        """(episode key, actor index, actor handle) for a new episode: the least loaded actor."""
        index = min(range(len(self.actors)), key=lambda i: (self.live[i], i))
        self.live[index] += 1
        return next(self._keys), index, self.actors[index]

    def _release(self, index: int, key: int, handle: Any, *, dead: bool) -> None:
        if self.actors[index] is not handle:
            return  # its actor was replaced: the count restarted with the new one
        self.live[index] -= 1
        if not dead and not self._closed:
            # Not awaited (`close` is synchronous): kept so `stats` can wait for them first.
            self._closing.append(handle.close.remote(key))
            if len(self._closing) > 1024:
                _, self._closing = self.ray.wait(self._closing, num_returns=len(self._closing),
                                                 timeout=0)

    def _actor_died(self, index: int, handle: Any) -> None:
        """Replace the actor at `index` once, however many of its episodes report its death."""
        if self.actors[index] is handle and not self._closed:
            self.actors[index] = self._new_actor()
            self.live[index] = 0
            self.replaced += 1
            perf.count(ACTOR_DEATHS, 1, actor=index)

    async def stats(self) -> list[dict[str, int]]:
        """Each current actor's `{"episodes", "calls", "active", "max_active"}` (this call
        counts against the actor's `max_concurrency` like any other), once the episode closes
        sent so far have been applied."""
        closing, self._closing = self._closing, []
        for ref in closing:
            with contextlib.suppress(self.ray.exceptions.RayError):  # its actor died since
                await ref
        return [await actor.stats.remote() for actor in self.actors]

    def shutdown(self) -> None:
        """Kill every actor; episodes still running on them fail."""
        self._closed = True
        for actor in self.actors:
            self.ray.kill(actor)

    def __enter__(self) -> RayEnvironmentPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class RayEnvironment(Environment):
    """One episode whose environment lives in a pool actor; the `Environment` interface."""

    def __init__(self, pool: RayEnvironmentPool) -> None:
        self.pool = pool
        self.tools = pool.template.tools
        self.system_prompt = pool.template.system_prompt
        self._placement: tuple[int, int, Any] | None = None  # key, actor index, handle
        self._dead = False

    def sample_task(self, seed: int, split: Split = "train") -> Task:
        return draw_task(self.pool.template, seed, split)

    def demonstration(self, task: Task) -> list[Message]:
        return self.pool.template.demonstration(task)

    async def _call(self, method: str, *args: Any) -> Any:
        assert self._placement is not None
        key, index, handle = self._placement
        ray = self.pool.ray
        try:
            return await getattr(handle, method).remote(key, *args)
        except ray.exceptions.RayActorError as error:
            self._dead = True
            self.pool._actor_died(index, handle)
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise EnvironmentActorDied(
                f"the Ray actor {index} hosting this episode's environment died during {method}; "
                f"the episode's state is lost (the pool replaced the actor for later episodes). "
                f"Ray said: {type(error).__name__}: {first}") from None
        except ray.exceptions.RayTaskError as error:
            cause = error.cause if isinstance(error.cause, BaseException) else None
            if cause is None:
                raise
            raise cause from None  # the environment's own error, as in-process

    async def reset(self, task: Task | None = None, *, seed: int = 0) -> Observation:
        self.close()  # a reset starts a new episode: leave the previous one's actor state
        self._placement, self._dead = self.pool._place(), False
        try:
            return await self._call("reset", task, seed)
        except EnvironmentActorDied:
            # Nothing was lost yet (the episode had no state), so start over once on the
            # actor that replaced the dead one, rather than failing the episode.
            self.close()
            self._placement, self._dead = self.pool._place(), False
            return await self._call("reset", task, seed)

    async def step(self, action: AgentAction) -> StepResult:
        if self._placement is None:
            raise RuntimeError("step() before reset()")
        return await self._call("step", action)

    async def final_reward(self) -> float:
        if self._placement is None:
            return 0.0
        return float(await self._call("final_reward"))

    def close(self) -> None:
        if self._placement is None:
            return
        key, index, handle = self._placement
        self._placement = None
        self.pool._release(index, key, handle, dead=self._dead)
