"""GSM8K-style word problems from a local JSONL or Parquet file.

Each record has a question and a worked solution ending in "#### <final answer>" (field names and
marker are settings). The final answer, commas removed, is the reference; the reward is
`numeric_match`; the demonstration is the worked solution, with GSM8K's "<<48/2=24>>" calculator
annotations removed unless asked to keep them. A malformed record is an error naming `file:line`
(JSONL) or `file:row N` (Parquet). Without an `eval_path`, problems are split by a stable hash of
the question (see `base.split_of`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nonstop.recipes.tasks.base import Split, TaskError, seeded_rng, split_of
from nonstop.rl.rewards import Example, Reward, numeric_match

_ANNOTATION = re.compile(r"<<[^<>]*>>")


def load_gsm8k(
    path: str | Path,
    *,
    question_field: str = "question",
    answer_field: str = "answer",
    marker: str = "####",
    prompt_template: str = "{question}",
    keep_annotations: bool = False,
) -> list[Example]:
    """Examples from a `.jsonl`/`.json` (one object per line) or `.parquet` file."""
    path = Path(path)
    if "{question}" not in prompt_template:
        raise ValueError(f"prompt_template = {prompt_template!r} must contain '{{question}}'")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        records = _jsonl_records(path)
    elif suffix == ".parquet":
        records = _parquet_records(path, (question_field, answer_field))
    else:
        raise TaskError(f"{path}: unknown file type {suffix!r}; use .jsonl, .json or .parquet")
    examples = []
    for where, record in records:
        missing = [f for f in (question_field, answer_field) if not isinstance(record.get(f), str)]
        if missing:
            raise TaskError(
                f"{where}: field(s) {missing} missing or not text; record has {sorted(record)}"
            )
        question, solution = record[question_field].strip(), record[answer_field]
        if marker not in solution:
            raise TaskError(f"{where}: answer field has no {marker!r} before the final answer")
        final = solution.rsplit(marker, 1)[1].strip().replace(",", "")
        if not final:
            raise TaskError(f"{where}: nothing after {marker!r} in the answer field")
        if not keep_annotations:
            solution = _ANNOTATION.sub("", solution)
        examples.append(
            Example(
                prompt=prompt_template.format(question=question),
                answer=final,
                metadata={"question": question, "solution": solution.strip(), "source": where},
                id=where,
            )
        )
    if not examples:
        raise TaskError(f"{path}: no records")
    return examples


def _jsonl_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(
                    f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            if not isinstance(record, dict):
                raise TaskError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record


def _parquet_records(path: Path, fields: tuple[str, str]) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TaskError(f"{path}: reading Parquet needs pyarrow: pip install 'nonstop[parquet]' "
                        "(or convert the file to JSONL)") from None

    schema = pq.read_schema(path)
    missing = [f for f in fields if f not in schema.names]
    if missing:
        raise TaskError(f"{path}: column(s) {missing} missing; file has {schema.names}")
    table = pq.read_table(path, columns=list(fields))
    for row, record in enumerate(table.to_pylist()):
        yield f"{path}:row {row}", record


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gsm8kTask:
    """Word problems loaded from files; see `from_file`."""

    train_set: tuple[Example, ...]
    eval_set: tuple[Example, ...]
    name: str = "gsm8k"
    marker: str = "####"

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        eval_path: str | Path | None = None,
        eval_fraction: float = 0.1,
        question_field: str = "question",
        answer_field: str = "answer",
        marker: str = "####",
        prompt_template: str = "{question}",
        keep_annotations: bool = False,
        name: str = "gsm8k",
    ) -> Gsm8kTask:
        """Training problems from `path`; held-out ones from `eval_path`, or, without it, the
        `eval_fraction` of `path` whose question hashes into the eval split."""
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(
                f"eval_fraction = {eval_fraction!r} is not valid; it must be in [0, 1)"
            )
        load = functools.partial(
            load_gsm8k,
            question_field=question_field,
            answer_field=answer_field,
            marker=marker,
            prompt_template=prompt_template,
            keep_annotations=keep_annotations,
        )
        examples = load(path)
        if eval_path is not None:
            train, held_out = examples, load(eval_path)
        else:
            train = [e for e in examples if split_of(e.prompt, eval_fraction) == "train"]
            held_out = [e for e in examples if split_of(e.prompt, eval_fraction) == "eval"]
        return cls(train_set=tuple(train), eval_set=tuple(held_out), name=name, marker=marker)

    @property
    def reward(self) -> Reward:
        return numeric_match(name=self.name, marker=self.marker)

    def demonstration(self, example: Example) -> str:
        return example.metadata["solution"]

    def sample(self, rng: random.Random) -> Example:
        if not self.train_set:
            raise TaskError(f"{self.name}: the training split is empty")
        return rng.choice(self.train_set)

    def _pool(self, split: Split) -> tuple[Example, ...]:
        if split not in ("train", "eval"):
            raise ValueError(f"split = {split!r} is not valid; use 'train' or 'eval'")
        return self.train_set if split == "train" else self.eval_set

    def iter_examples(self, split: Split, seed: int) -> Iterator[Example]:
        """Epoch after epoch of `split`, each in a fresh seeded order."""
        pool, rng = self._pool(split), seeded_rng(self.name, split, seed)
        if not pool:
            raise TaskError(f"{self.name}: the {split} split is empty")
        for _ in itertools.count():
            yield from rng.sample(pool, len(pool))

    def _take(self, split: Split, n: int, seed: int) -> list[Example]:
        pool = self._pool(split)
        if not (isinstance(n, int) and 0 <= n <= len(pool)):
            raise ValueError(f"n = {n!r} is not valid; the {split} split has {len(pool)} problems")
        return seeded_rng(self.name, split, seed).sample(pool, n)

    def train_examples(self, n: int, seed: int = 0) -> list[Example]:
        return self._take("train", n, seed)

    def eval_examples(self, n: int, seed: int = 0) -> list[Example]:
        return self._take("eval", n, seed)
