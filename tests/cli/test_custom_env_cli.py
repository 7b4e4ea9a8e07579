"""`nonstop agentic` and `nonstop rl` on a user's code named by import path: a module written into
a temporary directory on PYTHONPATH gives the tools, the reward, the tasks or a whole Environment;
a couple of training steps run end to end in a subprocess, as a user would run them; a mistake in
a path stops the run with one line naming the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

USER_MODULE = '''
"""A user's package: an "API" behind a tool, a reward, a task generator, an Environment."""
import asyncio
import random

from nonstop.agentic.environment import Task, ToolEnvironment
from nonstop.agentic.tools import ToolSet

POPULATION = {"Oslo": 709, "Lima": 10092, "Kyiv": 2952}


def population(city: str) -> int:
    """The population of a city, in thousands.

    Args:
        city: The city's name, e.g. Oslo.
    """
    return POPULATION[city]


async def distance(a: str, b: str, unit: str = "km") -> float:
    """The distance between two cities."""
    await asyncio.sleep(0.001)
    return 42.0


def score(prompt, completion, example):
    return float(example.answer in completion)


class CityEnv(ToolEnvironment):
    system_prompt = "Answer with a number."

    def __init__(self, cities: int = 3):
        self.cities = list(POPULATION)[:cities]
        super().__init__(tools=ToolSet(), reward_fn=lambda task, answer: float(len(answer) > 0))

    def sample_task(self, seed: int) -> Task:
        city = random.Random(seed).choice(self.cities)
        return Task(prompt=f"Population of {city}?", answer=str(POPULATION[city]))
'''

TINY = ["steps=2", "num_eval=2", "group_size=2", "groups_per_step=2", "max_concurrency=8",
        "engine.max_slots=8", "agent.max_tokens_per_turn=12", "agent.max_turns=2",
        "model.num_layers=1", "model.hidden_size=32", "model.head_dim=8"]


@pytest.fixture
def user_pkg(tmp_path: Path) -> Path:
    package = tmp_path / "pkg"
    (package / "citypkg").mkdir(parents=True)
    (package / "citypkg" / "__init__.py").write_text(textwrap.dedent(USER_MODULE))
    rows = [{"question": f"Population of {c}?", "population": n}
            for c, n in (("Oslo", 709), ("Lima", 10092), ("Kyiv", 2952))] * 4
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = [{"question": "Population of Oslo in thousands?", "population": 709}]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    return package


def nonstop(package: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), str(REPO)]),
           "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "nonstop", *args], capture_output=True,
                          text=True, env=env, cwd=package.parent, timeout=timeout)


def test_tools_reward_and_tasks_by_import_path_train_end_to_end(user_pkg, tmp_path):
    run_dir = tmp_path / "run"
    result = nonstop(user_pkg, "agentic", "--config", "agentic_calculator_tiny",
                     f"run_dir={run_dir}", *TINY,
                     "env.tools=[citypkg:population, citypkg:distance]",
                     "env.reward=citypkg:score", "env.tasks.path=train.jsonl",
                     "env.tasks.eval_path=test.jsonl",
                     "env.tasks.args={prompt_key: question, answer_key: population}",
                     "env.system_prompt=Use the tools, then answer.")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    recorded = (run_dir / "config.yaml").read_text()
    assert "citypkg:population" in recorded and "citypkg:score" in recorded


def test_an_environment_by_import_path_trains_end_to_end(user_pkg, tmp_path):
    run_dir = tmp_path / "run"
    result = nonstop(user_pkg, "agentic", "--config", "agentic_calculator_tiny",
                     f"run_dir={run_dir}", *TINY, "env.path=citypkg:CityEnv",
                     "env.args={cities: 2}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("overrides, message", [
    (["env.tools=[citypkg:population, citypkg:nosuch]", "env.reward=citypkg:score",
      "env.tasks.path=train.jsonl"],
     "env.tools[1]='citypkg:nosuch' is invalid; expected an attribute that exists; citypkg "
     "has no attribute 'nosuch'"),
    (["env.path=citypkg:CityEnv", "env.args={planets: 2}"],
     "env.args={'planets': 2} is invalid; expected keyword arguments citypkg:CityEnv accepts"),
    (["env.tools=[citypkg:population]", "env.reward=citypkg.rewards:score",
      "env.tasks.path=train.jsonl"],
     "env.reward='citypkg.rewards:score' is invalid; expected an importable module; importing "
     "'citypkg.rewards' raised ModuleNotFoundError"),
])
def test_a_bad_path_stops_the_run_with_one_line_naming_the_key(user_pkg, tmp_path, overrides,
                                                               message):
    result = nonstop(user_pkg, "agentic", "--config", "agentic_calculator_tiny",
                     f"run_dir={tmp_path / 'run'}", *overrides, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nonstop agentic: error: "), result.stderr
    assert message in lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything was built


RL_TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
           "model.head_dim=8", "warmup.steps=0", "rollout.group_size=4",
           "rollout.prompts_per_step=2", "rollout.max_new_tokens=4", "task.num_eval=4",
           "engine.max_slots=8", "engine.max_len=32", "packing.rows_per_batch=4",
           "eval_every=2", "steps=2", "checkpoint.save_every=100"]


def test_rl_on_a_users_generator_with_a_hash_split(user_pkg, tmp_path):
    (user_pkg / "sums.py").write_text(textwrap.dedent('''
        def problems(count):
            for i in range(count):
                yield {"prompt": f"{i}+1=", "answer": str(i + 1)}

        async def score(prompt, completion, example):
            return float(completion.strip() == example.answer)
    '''))
    run_dir = tmp_path / "run"
    result = nonstop(user_pkg, "rl", "--config", "grpo_arithmetic", f"run_dir={run_dir}",
                     *RL_TINY, "task.name=custom", "task.path=sums:problems",
                     "task.args={count: 400}", "task.eval_fraction=0.2", "task.reward=sums:score")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "metrics.jsonl").exists()
