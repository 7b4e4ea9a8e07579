"""Held out by construction: every built-in agentic environment and RL task splits its problems
into training and evaluation by a stable hash of the problem, the two sides never share a problem
however many are drawn, and the recipes evaluate on the eval side and train on the other."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nonstop.agentic.environment import HELD_OUT_SEED, Environment, Task, draw_task, split_of
from nonstop.agentic.envs import CalculatorEnv, GridWorldEnv, PythonEnv, RetrievalEnv
from nonstop.agentic.orchestrator import EpisodeSpec
from nonstop.models.char_tokenizer import char_tokenizer
from nonstop.recipes.agentic_recipe import AgenticRunConfig, EnvSettings, interaction_factory
from nonstop.recipes.rl_recipe import TaskSettings, build_task

N = 3000  # problems drawn from each side


def _calculator_key(task: Task) -> str:
    return task.info["expression"]  # names and items aside: the arithmetic is the problem


def _prompt(task: Task) -> str:
    return task.prompt


ENVS = {  # name: (environment, what identifies a problem)
    "calculator": (CalculatorEnv, _calculator_key),
    "gridworld": (GridWorldEnv, _prompt),
    "retrieval": (RetrievalEnv, _prompt),
    "python": (PythonEnv, _prompt),
}


def _fraction(env: Environment) -> float:
    return env.config.eval_fraction if hasattr(env, "config") else env.eval_fraction


@pytest.mark.parametrize("name", list(ENVS))
def test_environment_splits_are_disjoint_and_follow_the_hash(name: str) -> None:
    make, key = ENVS[name]
    env = make()
    drawn = {
        split: [env.sample_task(seed, split=split) for seed in range(N)]
        for split in ("train", "eval")
    }
    keys = {split: {key(t) for t in tasks} for split, tasks in drawn.items()}
    assert not keys["train"] & keys["eval"], f"{name}: a problem is in both splits"
    for split, tasks in drawn.items():
        assert all(split_of(key(t), _fraction(env)) == split for t in tasks), (name, split)
    # enough distinct problems on each side that the check above means something
    assert len(keys["eval"]) >= (15 if name == "retrieval" else 200), (name, len(keys["eval"]))
    assert env.sample_task(7, split="eval") == env.sample_task(7, split="eval")  # deterministic
    assert env.sample_task(7) == env.sample_task(7, split="train")  # training by default


def test_retrieval_enumerates_every_question_into_exactly_one_split() -> None:
    env = RetrievalEnv()
    train, held_out = ({t.prompt for t in env.splits[s]} for s in ("train", "eval"))
    assert train | held_out == {t.prompt for t in env.tasks} and not train & held_out
    assert {env.sample_task(s, split="eval").prompt for s in range(N)} == held_out


def test_split_errors_name_what_to_change() -> None:
    with pytest.raises(ValueError, match="split='test' is invalid"):
        CalculatorEnv().sample_task(0, split="test")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eval_fraction=0.01 leaves no eval question among 72"):
        RetrievalEnv(eval_fraction=0.01).sample_task(0, split="eval")
    with pytest.raises(ValueError, match="CalculatorConfig.eval_fraction=1.0 is invalid"):
        from nonstop.agentic.envs.calculator import CalculatorConfig

        CalculatorConfig(eval_fraction=1.0)


class _SeedOnlyEnv(CalculatorEnv):
    """A user's environment written before splits: `sample_task(seed)` alone."""

    def sample_task(self, seed: int) -> Task:  # type: ignore[override]
        return Task(prompt=f"seed {seed}", answer="0")


def test_seed_only_environments_keep_the_held_out_seed_convention() -> None:
    env = _SeedOnlyEnv()
    assert draw_task(env, 3, "train").prompt == "seed 3"
    assert draw_task(env, 3, "eval").prompt == f"seed {HELD_OUT_SEED + 3}"


@pytest.mark.parametrize("env_name", ["calculator", "gridworld"])
def test_the_agentic_recipe_evaluates_on_the_eval_split(env_name: str) -> None:
    # Operands up to 1,000: a space large enough for 64 distinct held-out problems (the demo's
    # max_operand=20 task has about 61 held-out problems in all, so 64 draws repeat some).
    cfg = AgenticRunConfig(env=EnvSettings(name=env_name, max_operand=1000), num_eval=64, seed=5)
    tokenizer = char_tokenizer("qwen")
    env = CalculatorEnv() if env_name == "calculator" else GridWorldEnv()
    key = _calculator_key if env_name == "calculator" else _prompt

    def tasks(split: str, n: int) -> list[Task]:
        make = interaction_factory(cfg, tokenizer, split)
        out = []
        for group in range(n):
            interaction = make(EpisodeSpec(group_id=group, index=0, episode_id=group, seed=0))
            out.append(interaction.task)
            interaction.close()
        return out

    held_out, train = tasks("eval", cfg.num_eval), tasks("train", 500)
    fraction = env.config.eval_fraction
    assert all(split_of(key(t), fraction) == "eval" for t in held_out)
    assert all(split_of(key(t), fraction) == "train" for t in train)
    assert not {key(t) for t in held_out} & {key(t) for t in train}
    assert len({key(t) for t in held_out}) == cfg.num_eval  # 64 distinct held-out problems


def _word_problems(path: Path, n: int) -> Path:
    """A GSM8K-style file of `n` distinct questions."""
    with path.open("w") as f:
        for i in range(n):
            a, b = divmod(i * 7919 % 100_003, 317)
            f.write(
                json.dumps(
                    {
                        "question": f"Ann has {a} pens and buys {b} more. How many?",
                        "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
                    }
                )
                + "\n"
            )
    return path


def _custom_problems(path: Path, n: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Reverse {i:05d}:", "answer": f"{i:05d}"[::-1]}) + "\n")
    return path


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "gsm8k", "custom"])
def test_rl_task_splits_are_disjoint_and_the_recipe_evaluates_on_eval(
    name: str, tmp_path: Path
) -> None:
    path = None
    if name == "gsm8k":
        path = str(_word_problems(tmp_path / "gsm8k.jsonl", 5000))
    elif name == "custom":
        path = str(_custom_problems(tmp_path / "custom.jsonl", 5000))
    settings = TaskSettings(name=name, path=path, num_eval=128)
    task = build_task(settings)
    stream = task.iter_examples("train", 0)
    train = {next(stream).prompt for _ in range(N)}
    stream = task.iter_examples("eval", 0)
    held_out = {next(stream).prompt for _ in range(N)}
    assert not train & held_out, f"{name}: a problem is in both splits"
    assert len(held_out) >= 100 and len(train) >= 1000, (name, len(held_out), len(train))
    assert all(split_of(p, 0.1) == "eval" for p in held_out)
    assert all(split_of(p, 0.1) == "train" for p in train)
    # what `nonstop rl` evaluates on (rl_recipe.run_rl: task.eval_examples(num_eval, seed + 1))
    evaluated = {e.prompt for e in task.eval_examples(settings.num_eval, seed=1)}
    assert len(evaluated) == settings.num_eval and not evaluated & train
    assert all(split_of(p, 0.1) == "eval" for p in evaluated)


def test_the_demo_never_trains_on_a_problem_it_evaluates(tmp_path: Path) -> None:
    """`nonstop demo`'s SFT demonstrations (the warm-up that made tests/fixtures/calculator_sft)
    and its RL training draws come from the train split; the problems it evaluates on, from the
    eval split: no arithmetic in common."""
    from nonstop.recipes.agentic_recipe import make_env
    from nonstop.recipes.agentic_warmup import write_demonstrations
    from nonstop.recipes.demo import DemoConfig

    demo = DemoConfig(run_dir=str(tmp_path))
    cfg = demo.agentic(warmup=True)
    data = tmp_path / "sft.jsonl"
    write_demonstrations(data, make_env(cfg.env), n=cfg.warmup.demonstrations, seed=cfg.seed,
                         tool_fraction=cfg.warmup.tool_fraction)
    # Every demonstration's arithmetic, read back from its word problem ("Tom has 7 pens and
    # gets 12 more"); a demonstration that calls the calculator calls it on exactly that.
    story = re.compile(r"has (\d+) \w+ and (gets|gives away) (\d+)")
    demonstrated, with_tool = set(), 0
    for line in data.read_text().splitlines():
        messages = json.loads(line)["messages"]
        start, verb, operand = story.search(messages[1]["content"]).groups()
        expression = f"{start} {'+' if verb == 'gets' else '-'} {operand}"
        demonstrated.add(expression)
        calls = [call["function"]["arguments"]["expression"]
                 for message in messages for call in message.get("tool_calls") or ()]
        assert calls in ([], [expression])
        with_tool += bool(calls)
    assert 1800 < with_tool < 2200  # half of the 4,000 call the calculator
    make = {split: interaction_factory(cfg, char_tokenizer("qwen"), split)
            for split in ("train", "eval")}

    def expressions(split: str, n: int) -> set[str]:
        out = set()
        for group in range(n):
            interaction = make[split](EpisodeSpec(group_id=group, index=0, episode_id=group,
                                                  seed=0))
            out.add(interaction.task.info["expression"])
            interaction.close()
        return out

    held_out = expressions("eval", cfg.num_eval)
    assert len(demonstrated) > 400 and held_out
    assert not demonstrated & held_out
    assert not expressions("train", 2000) & held_out
