"""Built-in environments: reset/step/reward with scripted agents, bad actions as observations,
and demonstrations that score full reward when replayed through the environment."""

import asyncio
import random

import pytest

from nonstop.agentic.environment import AgentAction, last_number
from nonstop.agentic.envs import (
    BM25Index,
    CalculatorConfig,
    CalculatorEnv,
    Document,
    GridWorldConfig,
    GridWorldEnv,
    PythonEnv,
    PythonEnvConfig,
    RetrievalEnv,
    evaluate,
    generate_corpus,
    load_documents,
    make_problem,
    shortest_path,
)
from nonstop.agentic.envs.calculator import (
    calculator_tool,
    count_operations,
    count_problems,
    solution_calls,
)
from nonstop.agentic.parsers import get_parser
from nonstop.agentic.sandbox import Sandbox, SandboxConfig
from nonstop.models.chat import ChatTemplate, ToolCall
from nonstop.models.validation import ConfigError


async def replay(env, task):
    """Drive `env` with the assistant turns of its own demonstration; check the tool turns match."""
    demo = env.demonstration(task)
    observation = await env.reset(task)
    assert [m.to_dict() for m in observation.messages()] == [m.to_dict() for m in demo[:2]]
    i, step = 2, None
    while i < len(demo):
        assistant = demo[i]
        step = await env.step(
            AgentAction.calls(*assistant.tool_calls, content=assistant.content)
            if assistant.tool_calls
            else AgentAction.answer(assistant.content)
        )
        n = len(step.messages)
        assert [m.to_dict() for m in step.messages] == [
            m.to_dict() for m in demo[i + 1 : i + 1 + n]
        ]
        i += 1 + n
    assert step is not None and step.done
    return step.reward, await env.final_reward()


def test_evaluate_is_safe_and_exact():
    assert evaluate("12 + 35") == 47 and evaluate("(3 - 10) * -2 / 4") == 3.5
    for bad in ("__import__('os')", "2 ** 100", "[1]", "1 / 0", "9" * 30 + " * " + "9" * 30):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_calculator_problems_are_consistent():
    config = CalculatorConfig(ops=("+", "-", "*", "/"), num_steps=3, max_operand=20, max_turns=4)
    for seed in range(40):
        task = make_problem(random.Random(seed), config)
        assert evaluate(task.info["expression"]) == int(task.answer) >= 0
        assert len(task.prompt) < 200
    assert make_problem(random.Random(3), config) == make_problem(random.Random(3), config)


def test_the_wide_calculator_needs_a_call_per_step():
    config = CalculatorConfig.wide()
    assert set(config.ops) == {"+", "-", "*", "/"} and config.max_operand >= 1000
    # every distinct problem counted (start value and operations; names and items aside)
    assert count_problems(config) > 10**9
    assert count_problems(CalculatorConfig(max_operand=20, ops=("+", "-"), num_steps=1)) == 610
    tasks = [make_problem(random.Random(seed), config) for seed in range(3000)]
    assert len({t.info["expression"] for t in tasks}) > 2980  # next to no repeats in 3000
    assert {op for t in tasks for op, _ in t.info["steps"]} == {"+", "-", "*", "/"}
    assert max(int(t.info["start"]) for t in tasks) > 990
    assert max(b for t in tasks for op, b in t.info["steps"] if op in "+/") > 900
    for task in tasks[:200]:
        calls = solution_calls(task, config)
        assert len(calls) == 2 and calls[-1][1] == int(task.answer)
        assert all(count_operations(expression) == 1 for expression, _ in calls)
        assert calls[1][0].startswith(f"{calls[0][1]} ")  # the second call uses the first's result
    assert len(solution_calls(tasks[0], CalculatorConfig.wide(ops_per_call=None))) == 1
    assert count_problems(CalculatorConfig()) < 10**4  # the default: the demo's small task


def test_the_calculator_takes_one_operation_per_call():
    async def main():
        env = CalculatorEnv(CalculatorConfig.wide())
        task = env.sample_task(3)
        await env.reset(task)
        whole = ToolCall(name="calculator", arguments={"expression": task.info["expression"]})
        return task, await env.step(AgentAction.calls(whole))

    task, refused = asyncio.run(main())
    assert not refused.done and refused.info["tool_errors"] == ["exception"]
    assert "2 operations in one call; this calculator does 1 per call" in refused.messages[0].content
    assert CalculatorEnv(CalculatorConfig(ops_per_call=None)).tools.names == ("calculator",)
    tool = calculator_tool(ops_per_call=None)
    assert asyncio.run(tool({"expression": task.info["expression"]})) == task.answer


def test_calculator_episode_with_parsed_text_and_errors():
    async def main():
        env = CalculatorEnv(CalculatorConfig(num_steps=1))
        task = env.sample_task(5)
        obs = await env.reset(task)
        assert obs.text == task.prompt and obs.messages()[0].role == "system"
        parser = get_parser("qwen")
        bad = await env.step(AgentAction.from_text("<tool_call>{nope</tool_call>", parser))
        assert not bad.done and bad.reward is None
        assert bad.messages[0].content.startswith("Error: ") and bad.info["tool_errors"] == [
            "invalid_json"
        ]
        call = {"name": "calculator", "arguments": {"expression": task.info["expression"]}}
        text = f"<tool_call>\n{__import__('json').dumps(call)}\n</tool_call>"
        good = await env.step(AgentAction.from_text(text, parser))
        assert good.messages[0].content == task.answer and good.messages[0].tool_call_id == "call_0"
        final = await env.step(AgentAction.from_text(f"So {task.answer}.<|im_end|>", parser))
        return final, await env.final_reward(), env.tools.error_counts

    final, reward, errors = asyncio.run(main())
    assert final.done and final.reward == reward == 1.0 and errors["invalid_json"] == 1


def test_calculator_wrong_answer_and_turn_limit():
    async def main():
        env = CalculatorEnv(CalculatorConfig(num_steps=1, max_turns=2))
        task = await env.reset(seed=1)
        wrong = await env.step(AgentAction.answer(str(int(task.task.answer) + 1)))
        env2 = CalculatorEnv(CalculatorConfig(num_steps=1, max_turns=2))
        await env2.reset(seed=1)
        call = ToolCall(name="calculator", arguments={"expression": "1+1"})
        first = await env2.step(AgentAction.calls(call))
        second = await env2.step(AgentAction.calls(call))
        return wrong, first, second

    wrong, first, second = asyncio.run(main())
    assert wrong.done and wrong.reward == 0.0
    assert not first.done and second.done and second.reward == 0.0


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("split", ["train", "eval"])
@pytest.mark.parametrize("ops_per_call", [1, 2, None])
def test_calculator_demonstrations_score_full_reward(seed, split, ops_per_call):
    env = CalculatorEnv(CalculatorConfig(num_steps=3, ops_per_call=ops_per_call))
    task = env.sample_task(seed, split=split)
    demo = env.demonstration(task)
    calls = [m for m in demo if m.tool_calls]
    assert len(calls) == {1: 3, 2: 2, None: 1}[ops_per_call]
    assert asyncio.run(replay(env, task)) == (1.0, 1.0)


def test_calculator_demonstration_renders_in_every_format():
    env = CalculatorEnv()
    demo = env.demonstration(env.sample_task(0))
    for chat_format in ("qwen", "llama3", "gemma"):
        text = ChatTemplate.builtin(chat_format, special_tokens={"bos_token": ""}).render(
            demo, tools=env.tools.schemas()
        )
        assert demo[-1].content in text and "calculator" in text


def test_python_env_demonstrations_and_a_failing_program():
    # cpu_s above timeout_s: a one-thread loop cannot spend 5 CPU seconds in 2 wall seconds, so
    # the wall clock always fires first (equal limits raced; the CPU limit has its own test).
    sandbox = Sandbox(SandboxConfig(timeout_s=2.0, cpu_s=5, memory_mb=128, max_concurrency=2))

    async def main():
        env = PythonEnv(sandbox=sandbox)
        rewards = [await replay(env, env.sample_task(seed)) for seed in range(3)]
        await env.reset(seed=0)
        call = ToolCall(name="python", arguments={"code": "print(1/0)"}, id="x")
        failing = await env.step(AgentAction.calls(call))
        looping = await env.step(
            AgentAction.calls(ToolCall(name="python", arguments={"code": "while 1: pass"}))
        )
        return rewards, failing, looping

    rewards, failing, looping = asyncio.run(main())
    assert rewards == [(1.0, 1.0)] * 3
    assert "ZeroDivisionError" in failing.messages[0].content
    assert failing.messages[0].content.endswith("[exit code 1]")
    assert "[killed: timed out after" in looping.messages[0].content


def test_shortest_path_by_hand():
    walls = frozenset({(0, 1), (1, 1)})
    assert shortest_path(3, 3, walls, (0, 0), (0, 2)) == [
        "down", "down", "right", "right", "up", "up"
    ]  # fmt: skip
    assert shortest_path(2, 2, frozenset({(0, 1), (1, 0)}), (0, 0), (1, 1)) is None


def test_gridworld_tool_and_text_moves():
    async def main():
        env = GridWorldEnv(GridWorldConfig(height=3, width=3, num_walls=0, step_penalty=0.1))
        task = env.sample_task(0)
        task = type(task)(
            prompt=task.prompt,
            answer="2",
            info={"start": (0, 0), "goal": (1, 1), "walls": ((0, 1),), "path": ("down", "right")},
        )
        await env.reset(task)
        bump = await env.step(
            AgentAction.calls(ToolCall(name="move", arguments={"direction": "right"}))
        )
        bad = await env.step(
            AgentAction.calls(ToolCall(name="move", arguments={"direction": "north"}))
        )
        none = await env.step(AgentAction.answer("hmm"))
        down = await env.step(AgentAction.answer("I go down."))
        right = await env.step(AgentAction.answer("right"))
        return bump, bad, none, down, right, await env.final_reward()

    bump, bad, none, down, right, reward = asyncio.run(main())
    assert bump.messages[0].content == "Blocked.\nA#.\n.G.\n..." and not bump.done
    assert bad.messages[0].content.startswith("Error: bad arguments for move")
    assert none.messages[0].role == "user" and "Reply with a move" in none.messages[0].content
    assert down.messages[0].content == ".#.\nAG.\n..."
    assert right.done and right.reward == reward == pytest.approx(1.0 - 0.1 * 3)


def test_gridworld_runs_out_of_moves():
    async def main():
        env = GridWorldEnv(GridWorldConfig(max_steps=2, step_penalty=0.05))
        task = env.sample_task(1)
        await env.reset(task)
        away = {"up": "down", "down": "up", "left": "right", "right": "left"}[task.info["path"][0]]
        moves = [ToolCall(name="move", arguments={"direction": away}) for _ in range(3)]
        return await env.step(AgentAction.calls(*moves))

    step = asyncio.run(main())
    assert step.done and len(step.messages) == 2 and step.reward == pytest.approx(-0.1)
    assert step.messages[-1].content.endswith("Out of moves.")


@pytest.mark.parametrize("seed", range(4))
def test_gridworld_demonstrations_score_full_reward(seed):
    config = GridWorldConfig(step_penalty=0.02)
    env = GridWorldEnv(config)
    task = env.sample_task(seed)
    expected = 1.0 - 0.02 * len(task.info["path"])
    assert asyncio.run(replay(env, task)) == (pytest.approx(expected), pytest.approx(expected))


def test_bm25_by_hand():
    docs = [Document(title="a", text="cat cat dog"), Document(title="b", text="dog")]
    index = BM25Index(docs, k1=1.5, b=0.75)
    # N=2, df(cat)=1: idf = ln(1 + 1.5/1.5) = ln 2; doc a: len 4 ("a" + 3 words), mean 3
    import math

    norm = 1.5 * (1 - 0.75 + 0.75 * 4 / 3)
    assert index.scores("cat") == pytest.approx([math.log(2) * 2 * 2.5 / (2 + norm), 0.0])
    assert [d.title for d in index.search("dog cat")] == ["a", "b"]
    assert index.search("zebra") == []


def test_retrieval_env_generated_and_from_directory(tmp_path):
    documents, tasks = generate_corpus(0)
    index = BM25Index(documents)
    for task in tasks:  # every question's own document ranks first
        assert index.search(task.prompt, 1)[0].title == task.info["doc"]

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "moon.txt").write_text("The moon Quorl orbits the planet Yess.")
    (tmp_path / "sun.txt").write_text("The star Ambra is orange.")
    docs = load_documents(tmp_path)
    assert [d.title for d in docs] == ["moon", "sun"]
    from nonstop.agentic.environment import Task

    env_tasks = [Task(prompt="Which planet does Quorl orbit?", answer="Yess")]

    async def main():
        env = RetrievalEnv(documents=docs, tasks=env_tasks)
        rewards = await replay(env, env_tasks[0])
        env2 = RetrievalEnv(corpus_seed=0)
        generated = [await replay(env2, env2.sample_task(s)) for s in range(5)]
        await env2.reset(seed=0)
        wrong = await env2.step(AgentAction.answer("I do not know"))
        return rewards, generated, wrong

    rewards, generated, wrong = asyncio.run(main())
    assert rewards == (1.0, 1.0) and generated == [(1.0, 1.0)] * 5
    assert wrong.done and wrong.reward == 0.0
    with pytest.raises(ValueError, match="both documents and tasks"):
        RetrievalEnv(documents=docs)


def test_last_number():
    assert last_number("first 3, then 1,234.5 apples") == 1234.5
    assert last_number("none") is None


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: CalculatorConfig(max_operand=1),
         r"^CalculatorConfig\.max_operand=1 is invalid; expected an int >= 2$"),
        (lambda: CalculatorConfig(ops=("+", "^")),
         r"^CalculatorConfig\.ops=\('\+', '\^'\) is invalid; expected a non-empty subset of "),
        (lambda: CalculatorConfig(num_steps=5),
         r"^CalculatorConfig\.num_steps=5 is invalid; expected an int in \[1, 4\]$"),
        (lambda: CalculatorConfig(max_factor=1),
         r"^CalculatorConfig\.max_factor=1 is invalid; expected an int >= 2$"),
        (lambda: CalculatorConfig(ops_per_call=0),
         r"^CalculatorConfig\.ops_per_call=0 is invalid; expected an int >= 1$"),
        (lambda: CalculatorConfig.wide(num_steps=3, max_turns=3),  # three calls, then the answer
         r"^CalculatorConfig\.max_turns=3 is invalid; expected an int >= 4$"),
        (lambda: CalculatorConfig(eval_fraction=0.0),
         r"^CalculatorConfig\.eval_fraction=0\.0 is invalid; expected a float in \(0, 1\)"),
        (lambda: GridWorldConfig(width=1),
         r"^GridWorldConfig\.width=1 is invalid; expected an int >= 2$"),
        (lambda: GridWorldConfig(height=2, width=2, num_walls=3),
         r"^GridWorldConfig\.num_walls=3 is invalid; expected an int in \[0, 2\]"),
        (lambda: GridWorldConfig(max_steps=0),
         r"^GridWorldConfig\.max_steps=0 is invalid; expected an int >= 1$"),
        (lambda: PythonEnvConfig(max_n=9),
         r"^PythonEnvConfig\.max_n=9 is invalid; expected an int >= 10$"),
    ],
)
def test_env_config_errors_name_field_value_and_valid_range(make, message):
    with pytest.raises(ConfigError, match=message):
        make()
