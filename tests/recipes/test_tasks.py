"""Built-in tasks: determinism, disjoint splits, correct answers, countdown validity, the GSM8K
loader on JSONL and Parquet files, and demonstrations that score 1.0 under their own reward."""

import asyncio
import json
import random
import re
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nonstop.models.validation import ConfigError
from nonstop.recipes.tasks import (
    ArithmeticTask,
    CountdownTask,
    Gsm8kTask,
    Task,
    TaskError,
    check_countdown,
    evaluate_expression,
    split_of,
)
from nonstop.rl.rewards import evaluate_rewards

TASKS = [
    ArithmeticTask(),
    ArithmeticTask(digits=3, ops=("+", "-", "*"), terms=3, allow_negative=True),
    CountdownTask(numbers=3),
    CountdownTask(numbers=4, max_number=50, min_target=10, max_target=200),
]


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_same_seed_same_examples_and_splits_disjoint(task: Task) -> None:
    first, again = task.train_examples(200, seed=3), task.train_examples(200, seed=3)
    assert [(e.prompt, e.answer) for e in first] == [(e.prompt, e.answer) for e in again]
    assert [e.prompt for e in task.train_examples(200, seed=4)] != [e.prompt for e in first]
    train = {e.prompt for e in task.train_examples(2000, seed=0)}
    held_out = task.eval_examples(200, seed=0)
    assert len({e.prompt for e in held_out}) == 200  # distinct
    assert train.isdisjoint(e.prompt for e in held_out)
    assert task.eval_examples(200, seed=0) == held_out
    # The split is a property of the problem, not the stream: sample() never yields eval problems.
    rng = random.Random(0)
    assert all(split_of(task.sample(rng).prompt, 0.1) == "train" for _ in range(300))
    assert isinstance(task, Task)


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_demonstrations_score_one_under_the_task_reward(task: Task) -> None:
    examples = task.train_examples(150, seed=1) + task.eval_examples(50, seed=1)
    completions = [task.demonstration(e) for e in examples]
    result = asyncio.run(
        evaluate_rewards(task.reward, [e.prompt for e in examples], completions, examples)
    )
    assert result.rewards.tolist() == [1.0] * len(examples)
    wrong = [c + "1" for c in completions]  # one digit too many is never right
    result = asyncio.run(
        evaluate_rewards(task.reward, [e.prompt for e in examples], wrong, examples)
    )
    assert result.rewards.sum() == 0.0 and not result.failures


def test_arithmetic_answers_by_hand() -> None:
    task = ArithmeticTask(digits=2, ops=("+", "-"))
    for e in task.train_examples(500, seed=0):
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", e.prompt).groups()
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert e.answer == str(value) and value >= 0 and int(a) < 100 and int(b) < 100
    seen_ops = {m for e in task.train_examples(200) for m in re.findall(r"[+-]", e.prompt)}
    assert seen_ops == {"+", "-"}
    # "*" binds tighter than "+": 2+3*4 = 14.
    assert evaluate_expression("2+3*4").value == 14
    r = task.reward
    example = task.train_examples(1)[0]
    assert r(example.prompt, f" {example.answer}\n", example) == 1.0


def test_task_settings_are_validated_with_the_field_named() -> None:
    with pytest.raises(ConfigError, match=r"^ArithmeticTask\.digits=0 is invalid; expected an "
                                          r"int in \[1, 9\]$"):
        ArithmeticTask(digits=0)
    with pytest.raises(ConfigError, match=r"^ArithmeticTask\.ops=\('/',\) is invalid; expected "
                                          r"a non-empty tuple of"):
        ArithmeticTask(ops=("/",))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^ArithmeticTask\.terms=9 is invalid; expected an "
                                          r"int in \[2, 8\]$"):
        ArithmeticTask(terms=9)
    with pytest.raises(ConfigError, match=r"^CountdownTask\.numbers=9 is invalid; expected an "
                                          r"int in \[2, 6\]$"):
        CountdownTask(numbers=9)
    with pytest.raises(ConfigError, match=r"^CountdownTask\.min_target=101 is invalid; expected "
                                          r"an int in \[0, max_target=100\]$"):
        CountdownTask(min_target=101)
    with pytest.raises(ConfigError, match=r"^CountdownTask\.eval_fraction=1\.5 is invalid; "
                                          r"expected a number in \(0, 1\)") as err:
        CountdownTask(eval_fraction=1.5)
    assert (err.value.field, err.value.value) == ("eval_fraction", 1.5)


# ------------------------------------------------------------------------------------ countdown


@pytest.mark.parametrize(
    ("completion", "numbers", "target", "reason"),
    [
        ("(3+5)*2", (3, 5, 2), 16, "correct"),
        ("<think>try</think><answer>(3+5)*2</answer>", (3, 5, 2), 16, "correct"),
        ("(3+5)*2 = 16", (3, 5, 2), 16, "correct"),
        ("2*(5+3)", (3, 5, 2), 16, "correct"),
        ("(3+5)*2", (3, 5, 2), 15, "evaluates to 16, not 15"),
        ("3*3+5+2", (3, 5, 2), 16, "uses [3] beyond"),  # reuse
        ("7+5+2", (3, 5, 2), 14, "uses [7] beyond"),  # not given
        ("3+5", (3, 5, 2), 8, "leaves [2] unused"),
        ("2/(4-4)", (4, 4, 2), 2, "division by zero"),
        ("3/2*4", (3, 2, 4), 6, "non-integer intermediate value 3/2"),
        ("-3+5+2", (3, 5, 2), 4, "unary"),
        ("2**3", (2, 3), 8, "Pow is not allowed"),
        ("5//2", (5, 2), 2, "FloorDiv is not allowed"),
        ("0x3+5+2", (3, 5, 2), 10, "not allowed"),
        ("__import__('os').system('echo pwned')", (3, 5, 2), 0, "not allowed"),
        ("", (3, 5, 2), 10, "no expression"),
    ],
)
def test_check_countdown(completion: str, numbers: tuple, target: int, reason: str) -> None:
    verdict = check_countdown(completion, numbers, target)
    assert verdict.correct == (reason == "correct")
    assert reason in verdict.reason


def test_countdown_rule_switches() -> None:
    assert check_countdown("3/2*4", (3, 2, 4), 6, integer_intermediates=False).correct
    assert check_countdown("3+5", (3, 5, 2), 8, use_all=False).correct
    assert not check_countdown("3*5+2", (3, 5, 2), 17, ops=("+", "-")).correct
    assert evaluate_expression("7/2*2").value == Fraction(7)
    assert evaluate_expression("(10-4)/4", ops=("-", "/")).numbers == (10, 4, 4)


def test_countdown_problems_are_in_range_and_demonstrations_use_each_number_once() -> None:
    task = CountdownTask(numbers=4, max_number=12, min_target=20, max_target=60)
    for e in task.train_examples(200, seed=2):
        target, numbers = e.metadata["target"], e.metadata["numbers"]
        assert 20 <= target <= 60 and e.answer == str(target)
        assert len(numbers) == 4 and all(1 <= n <= 12 for n in numbers)
        assert e.prompt == f"Make {target} from {','.join(map(str, numbers))}:"
        used = evaluate_expression(e.metadata["solution"], integer_intermediates=True)
        assert sorted(used.numbers) == sorted(numbers) and used.value == target


# ---------------------------------------------------------------------------------------- GSM8K

RECORDS = [
    {"question": "Tom has 3 bags of 4 apples. How many?", "answer": "3*4=<<3*4=12>>12\n#### 12"},
    {"question": "A car costs $1,234. Tax is 0. Total?", "answer": "Still 1,234.\n#### 1,234"},
    {"question": "Half of 9?", "answer": "9/2=<<9/2=4.5>>4.5\n#### 4.5"},
    {"question": "What is 10 - 15?", "answer": "10-15=-5\n#### -5"},
]


def _write_jsonl(path: Path, records: list, extra_lines: tuple[str, ...] = ()) -> Path:
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_gsm8k_jsonl_and_parquet_load_the_same(tmp_path: Path) -> None:
    jsonl = _write_jsonl(tmp_path / "train.jsonl", RECORDS)
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), parquet)
    from_jsonl = Gsm8kTask.from_file(jsonl, eval_path=jsonl)
    from_parquet = Gsm8kTask.from_file(parquet, eval_path=parquet)
    for task in (from_jsonl, from_parquet):
        assert [e.answer for e in task.train_set] == ["12", "1234", "4.5", "-5"]
        assert task.train_set[0].prompt == RECORDS[0]["question"]
        assert task.demonstration(task.train_set[0]) == "3*4=12\n#### 12"  # annotation removed
    assert from_jsonl.train_set[1].metadata["source"] == f"{jsonl}:2"
    assert from_parquet.train_set[1].metadata["source"] == f"{parquet}:row 1"


def test_gsm8k_demonstrations_and_reward(tmp_path: Path) -> None:
    task = Gsm8kTask.from_file(_write_jsonl(tmp_path / "t.jsonl", RECORDS), eval_path=None)
    examples = list(task.train_set) + list(task.eval_set)
    assert len(examples) == 4
    r = task.reward
    assert all(r(e.prompt, task.demonstration(e), e) == 1.0 for e in examples)
    half = next(e for e in examples if e.answer == "4.5")
    assert r(half.prompt, "It is 4.5 apples.", half) == 1.0
    assert r(half.prompt, "#### 4", half) == 0.0
    assert r(half.prompt, "\\boxed{9/2}", half) == 1.0


def test_gsm8k_field_names_template_and_splits(tmp_path: Path) -> None:
    records = [{"q": f"What is {i} + 1?", "sol": f"#### {i + 1}"} for i in range(200)]
    path = _write_jsonl(tmp_path / "renamed.jsonl", records)
    task = Gsm8kTask.from_file(
        path, question_field="q", answer_field="sol", prompt_template="Q: {question}\nA:"
    )
    assert task.train_set[0].prompt.startswith("Q: What is") and task.train_set[0].prompt.endswith(
        "A:"
    )
    assert len(task.train_set) + len(task.eval_set) == 200 and 5 <= len(task.eval_set) <= 40
    train = {e.prompt for e in task.train_set}
    assert train.isdisjoint(e.prompt for e in task.eval_set)
    assert task.train_examples(10, seed=7) == task.train_examples(10, seed=7)
    assert task.train_examples(10, seed=7) != task.train_examples(10, seed=8)
    stream = task.iter_examples("train", seed=0)
    first_epoch = [next(stream) for _ in range(len(task.train_set))]
    assert sorted(e.prompt for e in first_epoch) == sorted(train)  # each once per epoch
    with pytest.raises(ValueError, match=r"the eval split has \d+ problems"):
        task.eval_examples(len(task.eval_set) + 1)


@pytest.mark.parametrize(
    ("extra_line", "message"),
    [
        ("{not json", r"bad.jsonl:5: not valid JSON"),
        ('["a", "b"]', r"bad.jsonl:5: expected a JSON object"),
        ('{"question": "q"}', r"bad.jsonl:5: field\(s\) \['answer'\] missing"),
        ('{"question": "q", "answer": "no marker 7"}', r"bad.jsonl:5: answer field has no '####'"),
        ('{"question": "q", "answer": "#### "}', r"bad.jsonl:5: nothing after '####'"),
    ],
)
def test_gsm8k_malformed_jsonl_names_file_and_line(
    tmp_path: Path, extra_line: str, message: str
) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", RECORDS, (extra_line,))
    with pytest.raises(TaskError, match=message):
        Gsm8kTask.from_file(path)


def test_gsm8k_parquet_errors(tmp_path: Path) -> None:
    path = tmp_path / "cols.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "q", "answer": "#### 1"}]), path)
    with pytest.raises(TaskError, match=r"column\(s\) \['question'\] missing"):
        Gsm8kTask.from_file(path)
    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS + [{"question": None, "answer": "#### 1"}]), rows)
    with pytest.raises(TaskError, match=r"rows.parquet:row 4: field\(s\) \['question'\]"):
        Gsm8kTask.from_file(rows)
    with pytest.raises(TaskError, match="unknown file type '.csv'"):
        Gsm8kTask.from_file(tmp_path / "x.csv")
