"""Environments on Ray (one local Ray of 2 CPUs for the module): the agentic calculator recipe gives
the same trajectories with its environments in Ray actors as in-process; tools and the Python
sandbox run inside the actor; an actor runs at most `max_concurrency` calls at once; a killed actor
fails (and counts) exactly the episodes it hosted while the run goes on on a replacement."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from nonstop.agentic.config import (  # noqa: E402
    OrchestratorConfig,
    StreamingLearnerConfig,
)
from nonstop.agentic.environment import AgentAction, StepResult, Task  # noqa: E402
from nonstop.agentic.envs import CalculatorEnv, PythonEnv  # noqa: E402
from nonstop.agentic.envs.calculator import CalculatorConfig  # noqa: E402
from nonstop.agentic.orchestrator import RolloutOrchestrator  # noqa: E402
from nonstop.agentic.ray_backend import (  # noqa: E402
    EnvironmentActorDied,
    RayEnvConfig,
    RayEnvironmentPool,
    import_ray,
    init_ray,
)
from nonstop.agentic.streaming import StreamingLearner  # noqa: E402
from nonstop.engine import Engine, EngineConfig  # noqa: E402
from nonstop.models.chat import ToolCall  # noqa: E402
from nonstop.models.config import ConfigError  # noqa: E402
from nonstop.models.source import build_model, build_tokenizer  # noqa: E402
from nonstop.recipes.agentic_recipe import (  # noqa: E402
    AgenticRunConfig,
    agent_config,
    interaction_factory,
    make_env,
    run_agentic,
)
from nonstop.recipes.config_io import load_config  # noqa: E402
from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig  # noqa: E402

TINY = Path(__file__).parents[2] / "nonstop/recipes/configs/agentic_calculator_tiny.yaml"
SMALL_ACTORS = dict(num_cpus_per_actor=0.25)  # 2 shared CPUs: actors mostly wait

# The slow environment below is defined here, so Ray ships this module to its workers by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


SMALL_TASK = CalculatorConfig(max_operand=20, ops=("+", "-"), num_steps=1)


class SlowCalculatorEnv(CalculatorEnv):
    """A calculator whose every step first waits `delay_s` (a slow tool, in effect)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(SMALL_TASK)
        self.delay_s = delay_s

    async def step(self, action: AgentAction) -> StepResult:
        await asyncio.sleep(self.delay_s)
        return await super().step(action)


class GatedCalculatorEnv(CalculatorEnv):
    """A calculator whose every step waits until the file `gate` exists: a tool that answers only
    when the test says so, so that a test can act while episodes are inside their step however
    fast or slow the machine is (a fixed delay left a window that a loaded machine could miss)."""

    def __init__(self, gate: str) -> None:
        super().__init__(SMALL_TASK)
        self.gate = Path(gate)

    async def step(self, action: AgentAction) -> StepResult:
        while not self.gate.exists():
            await asyncio.sleep(0.02)
        return await super().step(action)


async def _wait_until(condition, run: asyncio.Task, what: str, timeout_s: float = 120.0) -> None:
    """Poll the async `condition` until it holds; fail if `run` ended first or time runs out."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert not run.done(), f"the run ended before {what}"
        assert asyncio.get_running_loop().time() < deadline, f"{what} did not happen in {timeout_s} s"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def local_ray():
    assert init_ray(RayEnvConfig(), num_cpus=2, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def recipe():
    """The tiny calculator recipe's config, tokenizer and engine (shorter turns, same path)."""
    cfg = load_config(AgenticRunConfig, TINY, ["agent.max_tokens_per_turn=24", "seed=3"])
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    model = build_model(cfg.model, tokenizer, seed=cfg.seed)
    with Engine(model, EngineConfig(max_slots=16, max_len=cfg.engine.max_len), tokenizer=tokenizer) as engine:
        yield cfg, tokenizer, engine


def _orchestrator(recipe, new_env, concurrency=12):
    cfg, tokenizer, engine = recipe
    config = OrchestratorConfig(group_size=cfg.group_size, max_concurrency=concurrency,
                                seed=cfg.seed, agent=agent_config(cfg, tokenizer))
    return RolloutOrchestrator(engine, interaction_factory(cfg, tokenizer, "train", new_env),
                               config)


@pytest.mark.parametrize("env_name", ["calculator", "gridworld"])
def test_recipe_trajectories_on_ray_equal_in_process_ones(local_ray, recipe, env_name):
    # The random model answers the calculator in one turn (no tool call); on the grid its text
    # names no move, so every turn is stepped and observed until max_turns: multi-turn on Ray.
    cfg = dataclasses.replace(recipe[0], env=dataclasses.replace(recipe[0].env, name=env_name))
    recipe = (cfg, *recipe[1:])
    groups = [0, 1, 2]
    local = asyncio.run(_orchestrator(recipe, None).run_groups(groups))
    with RayEnvironmentPool(functools.partial(make_env, cfg.env),
                            RayEnvConfig(num_actors=2, max_concurrency=4, **SMALL_ACTORS)) as pool:
        on_ray = asyncio.run(_orchestrator(recipe, pool.environment).run_groups(groups))
        stats = asyncio.run(pool.stats())
    # Both actors hosted episodes (12 placed least-loaded first: 6 each), and every episode's
    # state was released when it ended.
    assert [s["episodes"] for s in stats] == [0, 0]
    assert all(s["calls"] >= 6 * 3 for s in stats)  # reset, >= 1 step, final reward each
    assert pool.replaced == 0
    for gid in groups:
        assert len(local[gid]) == len(on_ray[gid]) == cfg.group_size
        for a, b in zip(local[gid], on_ray[gid], strict=True):
            assert a.info["status"] == b.info["status"] != "error", b.info.get("error")
            assert a.info["turns"] == b.info["turns"] >= 1
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
            np.testing.assert_array_equal(a.behavior_logprobs, b.behavior_logprobs)
            assert a.reward == b.reward
    # The G episodes of a group sample differently (distinct seeds), on either backend.
    assert len({t.tokens.tobytes() for t in on_ray[0]}) == cfg.group_size
    turns = {t.info["turns"] for g in on_ray.values() for t in g}
    assert turns == ({1} if env_name == "calculator" else {cfg.agent.max_turns})


def test_tools_and_the_python_sandbox_run_inside_the_actor(local_ray):
    task = Task(prompt="Tom has 12 apples and gets 35 more. How many apples now?", answer="47")
    call = ToolCall(name="calculator", arguments={"expression": "12 + 35"}, id="call_0")

    async def episode(env):
        observation = await env.reset(task)
        tool_turn = await env.step(AgentAction.calls(call))
        answer = await env.step(AgentAction.answer("The answer is 47."))
        return observation, tool_turn, answer, await env.final_reward()

    with RayEnvironmentPool(CalculatorEnv, RayEnvConfig(num_actors=1, **SMALL_ACTORS)) as pool:
        env = pool.environment()
        observation, tool_turn, answer, reward = asyncio.run(episode(env))
        actor_pid = ray.get(pool.actors[0].pid.remote())
        env.close()
    assert actor_pid != os.getpid()
    assert observation.text == task.prompt and observation.system == CalculatorEnv.system_prompt
    assert [m.content for m in tool_turn.messages] == ["47"] and not tool_turn.done
    assert answer.done and answer.reward == reward == 1.0
    assert asyncio.run(episode(CalculatorEnv())) == (observation, tool_turn, answer, reward)

    code = "print(sum(i * i for i in range(1, 11)))"  # 1 + 4 + ... + 100 = 385
    python_call = ToolCall(name="python", arguments={"code": code}, id="call_0")

    async def python_episode(env):
        await env.reset(seed=5)
        return await env.step(AgentAction.calls(python_call))

    with RayEnvironmentPool(PythonEnv, RayEnvConfig(num_actors=1, **SMALL_ACTORS)) as pool:
        result = asyncio.run(python_episode(pool.environment()))
    assert [m.content.strip() for m in result.messages] == ["385"]


def test_an_actor_runs_at_most_max_concurrency_calls(local_ray):
    answer = AgentAction.answer("0")

    async def episode(env):
        await env.reset(seed=1)
        return await env.step(answer)

    factory = functools.partial(SlowCalculatorEnv, 0.3)
    with RayEnvironmentPool(factory, RayEnvConfig(num_actors=1, max_concurrency=2,
                                                  **SMALL_ACTORS)) as pool:
        envs = [pool.environment() for _ in range(6)]

        async def main():
            return await asyncio.gather(*(episode(e) for e in envs))

        results = asyncio.run(main())
        (stats,) = asyncio.run(pool.stats())
    assert all(r.done for r in results)
    # Six 0.3 s steps were in flight at once; the actor let exactly two run together.
    assert stats["max_active"] == 2 and stats["calls"] == 12


def test_a_killed_actor_fails_its_episodes_and_the_run_goes_on(local_ray, recipe, tmp_path):
    gate = tmp_path / "gate"
    factory = functools.partial(GatedCalculatorEnv, str(gate))
    with RayEnvironmentPool(factory, RayEnvConfig(num_actors=2, max_concurrency=8,
                                                  **SMALL_ACTORS)) as pool:
        orchestrator = _orchestrator(recipe, pool.environment, concurrency=8)
        first_actor = pool.actors[0]

        async def all_inside_their_step():
            return [s["active"] for s in await pool.stats()] == [4, 4]

        async def run_and_kill():
            run = asyncio.create_task(orchestrator.run_groups([0, 1]))
            # All 8 episodes wait inside their step at the gate, 4 on each actor.
            await _wait_until(all_inside_their_step, run, "all 8 episodes were inside a step")
            ray.kill(first_actor)
            gate.touch()  # actor 1's episodes answer and end
            return await run

        first = asyncio.run(run_and_kill())
        episodes = [t for g in first.values() for t in g]
        failed = [t for t in episodes if t.info["status"] == "error"]
        assert len(failed) == 4 and len(episodes) == 8
        for t in failed:
            assert t.info["error"].startswith("EnvironmentActorDied: the Ray actor 0 hosting")
            assert "died during step" in t.info["error"] and t.reward == 0.0
        assert orchestrator.status == {"error": 4, "done": 4}
        assert pool.replaced == 1 and pool.actors[0] is not first_actor

        # The same orchestrator goes on: new episodes land on the replacement and complete,
        # even those placed on actor 1, killed while idle: a reset that finds its actor dead
        # has lost nothing yet, so it starts over on that actor's replacement.
        ray.kill(pool.actors[1])
        second = asyncio.run(orchestrator.run_groups([2, 3]))
        assert all(t.info["status"] == "done" for g in second.values() for t in g)
        assert orchestrator.status == {"error": 4, "done": 12}
        assert pool.replaced == 2
        stats = asyncio.run(pool.stats())
        assert [s["episodes"] for s in stats] == [0, 0]
        assert all(s["calls"] >= 4 * 3 for s in stats)  # reset, step, final reward each


def test_a_killed_actor_mid_training_drops_its_groups_and_training_goes_on(local_ray, recipe,
                                                                          tmp_path):
    cfg, tokenizer, engine = recipe
    trainer = PolicyTrainer(build_model(cfg.model, tokenizer, seed=cfg.seed), PolicyTrainerConfig(
        algorithm=cfg.algorithm_config(), optimizer=cfg.optimizer, packing=cfg.packing,
        seed=cfg.seed))
    learner_cfg = StreamingLearnerConfig(groups_per_step=2, max_staleness=1, orchestrator=OrchestratorConfig(
        group_size=2, max_concurrency=8, seed=cfg.seed, agent=agent_config(cfg, tokenizer)))
    gate = tmp_path / "gate"
    factory = functools.partial(GatedCalculatorEnv, str(gate))
    with RayEnvironmentPool(factory, RayEnvConfig(num_actors=2, max_concurrency=8,
                                                  **SMALL_ACTORS)) as pool:
        learner = StreamingLearner(trainer, engine,
                                   interaction_factory(cfg, tokenizer, "train", pool.environment),
                                   learner_cfg)

        async def an_episode_inside_its_step_on_actor_0():
            return (await pool.stats())[0]["active"] >= 1

        async def train_and_kill():
            run = asyncio.create_task(learner.run(2))
            await _wait_until(an_episode_inside_its_step_on_actor_0, run,
                              "an episode was inside its step on actor 0")
            ray.kill(pool.actors[0])
            gate.touch()
            return await run

        records = asyncio.run(train_and_kill())
    assert len(records) == 2 and pool.replaced == 1
    failed = learner.orchestrator.status["error"]
    assert failed >= 1 and learner.queue.dropped["episode_failed"] >= 1
    # Every trained group is whole: 2 steps x 2 groups x 2 episodes, none of them failed.
    assert sum(len(r.staleness) for r in records) == 8
    assert learner.orchestrator.status["done"] >= 8


def test_the_recipe_runs_with_environments_on_ray(local_ray, tmp_path):
    cfg = load_config(AgenticRunConfig, TINY, [
        f"run_dir={tmp_path}", "steps=2", "num_eval=2", "group_size=2", "groups_per_step=2",
        "max_concurrency=8", "engine.max_slots=8", "agent.max_tokens_per_turn=16",
        "agent.max_turns=2", "env.backend=ray", "env.ray.num_actors=2",
        "env.ray.num_cpus_per_actor=0.25"])
    summary = run_agentic(cfg, progress=False)
    assert summary["steps"] == 2
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert ray.is_initialized()  # the recipe joined the running Ray and left it running


def test_backend_settings_are_validated_with_the_key_named():
    with pytest.raises(ConfigError, match="env.backend"):
        load_config(AgenticRunConfig, TINY, ["env.backend=docker"])
    with pytest.raises(ConfigError, match="env.ray.num_actors=0"):
        load_config(AgenticRunConfig, TINY, ["env.backend=ray", "env.ray.num_actors=0"])
    with pytest.raises(ConfigError, match="address"):
        RayEnvConfig(address=" ")


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` sees when it is missing
    with pytest.raises(ImportError, match=r"pip install nonstop\[ray\]"):
        import_ray()
    with pytest.raises(ImportError, match=r"pip install nonstop\[ray\]"):
        RayEnvironmentPool(CalculatorEnv)


def test_episode_errors_raised_in_the_actor_come_back_as_themselves(local_ray):
    async def step_before_reset_in_actor(pool):
        env = pool.environment()
        await env.reset(seed=2)
        await env.step(AgentAction.answer("1"))
        return await env.step(AgentAction.answer("2"))  # after the episode ended

    with RayEnvironmentPool(CalculatorEnv, RayEnvConfig(num_actors=1, **SMALL_ACTORS)) as pool:
        with pytest.raises(RuntimeError, match="after the episode ended") as caught:
            asyncio.run(step_before_reset_in_actor(pool))
    assert type(caught.value) is RuntimeError
    assert not isinstance(caught.value, EnvironmentActorDied)
