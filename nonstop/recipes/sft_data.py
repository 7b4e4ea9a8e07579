"""Built-in SFT and preference data for tiny models, written as JSONL into a run directory.

Two synthetic tasks, each a one-turn chat (`{"messages": [user, assistant]}` for SFT;
`{"prompt": [user], "chosen": [assistant], "rejected": [assistant]}` for DPO / ORPO):
- `reverse`: the user sends a short lowercase string ("dbfa"), the answer is it reversed
  ("afbd"). Rejected answers are the string unreversed, or the reversal with one letter changed.
- `arithmetic`: `nonstop.recipes.tasks.ArithmeticTask` (2-digit + and -: "12+35=" -> "47");
  rejected answers are the value off by 1-10.
With `builtin_data.rejected=shout` the rejected answer is instead the right one in upper case
(or, for digits, with a "!"): a style preference.

Held-out examples never share a prompt with training ones. `prepare_run(cfg)` resolves a run
config's built-in pieces — writes `RUN_DIR/data/{train,eval}.jsonl` for `builtin_data` and builds
the character tokenizer for `tokenizer.kind=char` — and returns the config with `data` pointing
at the files, so the trainer below never knows about recipes. The same seed writes the same bytes,
so a resumed run reads the same data.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Any

from nonstop.models.char_tokenizer import char_tokenizer
from nonstop.models.tokenizer import Tokenizer
from nonstop.recipes.tasks.arithmetic import ArithmeticTask
from nonstop.recipes.tasks.base import split_of
from nonstop.sft.config import BuiltinData, SFTRunConfig
from nonstop.sft.data import DataConfig

LETTERS = "abcdefgh"
EVAL_FRACTION = 0.1
DATA_DIR = "data"
TRAIN_FILE = "train.jsonl"
EVAL_FILE = "eval.jsonl"


@dataclasses.dataclass(frozen=True)
class TaskExample:
    """A prompt, its correct answer and a wrong one (for preference pairs)."""

    prompt: str
    answer: str
    wrong: str


def reverse_examples(spec: BuiltinData) -> tuple[list[TaskExample], list[TaskExample]]:
    """(train, held-out) examples of the string-reversal task; a stable hash of the prompt picks
    its split (as `nonstop.recipes.tasks` does), so no prompt is in both."""
    rng = random.Random(f"reverse/{spec.seed}")
    space = sum(len(LETTERS) ** n for n in range(spec.min_length, spec.max_length + 1))
    if spec.num_eval > space * EVAL_FRACTION / 2:
        raise ValueError(
            f"builtin_data.num_eval={spec.num_eval} is too many distinct held-out prompts for "
            f"lengths {spec.min_length}..{spec.max_length} over {len(LETTERS)} letters"
        )
    train: list[TaskExample] = []
    held_out: dict[str, TaskExample] = {}
    while len(train) < spec.num_train or len(held_out) < spec.num_eval:
        length = rng.randint(spec.min_length, spec.max_length)
        text = "".join(rng.choice(LETTERS) for _ in range(length))
        example = TaskExample(prompt=text, answer=text[::-1], wrong=_wrong_reversal(text, rng))
        if split_of(text, EVAL_FRACTION) == "eval":
            if len(held_out) < spec.num_eval:
                held_out.setdefault(text, example)
        elif len(train) < spec.num_train:
            train.append(example)
    return train, list(held_out.values())


def _wrong_reversal(text: str, rng: random.Random) -> str:
    if text != text[::-1] and rng.random() < 0.5:
        return text  # not reversed at all
    answer = list(text[::-1])
    index = rng.randrange(len(answer))
    answer[index] = rng.choice([c for c in LETTERS if c != answer[index]])
    return "".join(answer)


def arithmetic_examples(spec: BuiltinData) -> tuple[list[TaskExample], list[TaskExample]]:
    """(train, held-out) examples of 2-digit addition and subtraction."""
    task = ArithmeticTask()
    rng = random.Random(f"arithmetic/{spec.seed}")

    def convert(example: Any) -> TaskExample:
        value = int(example.answer)
        wrong = max(value + rng.choice([-1, 1]) * rng.randint(1, 10), 0)
        wrong = wrong if wrong != value else value + 1
        return TaskExample(example.prompt, task.demonstration(example), str(wrong))

    return (
        [convert(e) for e in task.train_examples(spec.num_train, seed=spec.seed)],
        [convert(e) for e in task.eval_examples(spec.num_eval, seed=spec.seed)],
    )


def task_examples(spec: BuiltinData) -> tuple[list[TaskExample], list[TaskExample]]:
    """(train, held-out) examples of `spec.task`, rejected answers as `spec.rejected` says."""
    train, held_out = (reverse_examples if spec.task == "reverse" else arithmetic_examples)(spec)
    if spec.rejected == "shout":
        train, held_out = ([dataclasses.replace(e, wrong=_shout(e.answer)) for e in examples]
                           for examples in (train, held_out))
    return train, held_out


def _shout(answer: str) -> str:
    return answer.upper() if answer.upper() != answer else f"{answer}!"


def sft_record(example: TaskExample) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": example.prompt},
            {"role": "assistant", "content": example.answer},
        ]
    }


def preference_record(example: TaskExample) -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": example.prompt}],
        "chosen": [{"role": "assistant", "content": example.answer}],
        "rejected": [{"role": "assistant", "content": example.wrong}],
    }


def write_builtin_data(
    spec: BuiltinData, directory: str | os.PathLike, *, preference: bool
) -> tuple[str, str]:
    """Writes train.jsonl and eval.jsonl (chat or preference records) into `directory`."""
    os.makedirs(directory, exist_ok=True)
    train, held_out = task_examples(spec)
    record = preference_record if preference else sft_record
    paths = []
    for name, examples in ((TRAIN_FILE, train), (EVAL_FILE, held_out)):
        path = os.path.join(directory, name)
        text = "".join(json.dumps(record(e)) + "\n" for e in examples)
        _write_if_changed(path, text)
        paths.append(path)
    return paths[0], paths[1]


def _write_if_changed(path: str, text: str) -> None:
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            if handle.read() == text:
                return
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


def prepare_run(cfg: SFTRunConfig) -> tuple[SFTRunConfig, Tokenizer | None]:
    """Resolve built-in data and tokenizer: the config with `data` set, and the tokenizer (None
    when the trainer should load a pretrained one from disk)."""
    tokenizer = char_tokenizer(cfg.tokenizer.chat_format) if cfg.tokenizer.kind == "char" else None
    if cfg.builtin_data is None:
        return cfg, tokenizer
    train_path, _ = write_builtin_data(
        cfg.builtin_data, os.path.join(cfg.run_dir, DATA_DIR), preference=cfg.algorithm != "sft"
    )
    data = DataConfig(
        paths=(train_path,),
        kind="preference" if cfg.algorithm != "sft" else "chat",
        seed=cfg.seed,
        num_epochs=None,
        read_threads=1,
    )
    return dataclasses.replace(cfg, data=data, builtin_data=None), tokenizer
