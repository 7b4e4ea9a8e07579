"""A user's own prompts and answers: a JSONL file or a Python function, with a held-out split.

    task:                                   # nonstop rl
      name: custom
      path: data/train.jsonl                # or "my_pkg.data:problems", a function or iterable
      args: {prompt_key: question}          # JSONL: which keys; a function: its kwargs
      eval_path: data/test.jsonl            # the held-out split; unset: a hash split
      eval_fraction: 0.1
      reward: "my_pkg.rewards:score"        # (prompt, completion, example) -> float

A JSONL line is an object with the prompt and the answer (keys `prompt` and `answer`, or the ones
`args.prompt_key` / `args.answer_key` name); its other keys become `Example.metadata`. A function
is called with `args` as keyword arguments and returns or yields `Example`s, mappings with
`prompt` and `answer`, or `(prompt, answer)` pairs; at most `MAX_EXAMPLES` are read, so an endless
generator is fine. Without `eval_path` a problem is held out when a stable hash of its prompt
falls below `eval_fraction` (`split_of`, as for the built-in generated tasks), so training and
evaluation never share a prompt whatever the seed.

Paths are checked when the config is loaded (the file exists, the module imports, the function
accepts `args`); the data itself is read when the run starts, before any model is built.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import os
import random
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from nonstop.agentic.plugins import import_object, load_reward
from nonstop.models.validation import check, invalid
from nonstop.recipes.tasks.base import Split, TaskError, seeded_rng, split_of
from nonstop.rl.rewards import Example, Reward, exact_match

MAX_EXAMPLES = 10_000  # read from a function at most; an endless generator stops here
_JSONL_ARGS = ("prompt_key", "answer_key")


def is_import_path(value: str) -> bool:
    """`package.module:attribute` rather than a file path."""
    head, sep, tail = value.partition(":")
    return bool(sep) and bool(tail) and "/" not in value and not os.path.exists(value) and \
        all(part.isidentifier() for part in head.split(".") + tail.split("."))


def check_source(value: Any, args: Any, *, owner: str, field: str) -> None:
    """`value` must be an existing .jsonl file or an import path to a function or an iterable
    that `args` fits; a ConfigError on `owner.field` (or `owner.args`) otherwise."""
    if not isinstance(value, str) or not value:
        raise invalid(owner, field, value, "a JSONL file or an import path 'module:function'")
    check(args is None or isinstance(args, Mapping), owner, "args", args,
          "a mapping of keyword arguments (or null)")
    kwargs = dict(args or {})
    if is_import_path(value):
        obj = import_object(value, owner=owner, field=field)
        if callable(obj):
            try:
                inspect.signature(obj).bind(**kwargs)
            except TypeError as error:
                raise invalid(owner, "args", kwargs, f"keyword arguments {value} accepts "
                              f"({error}; its signature: {inspect.signature(obj)})") from None
            except ValueError:
                pass
        elif isinstance(obj, Iterable) and not isinstance(obj, str | bytes | Mapping):
            check(not kwargs, owner, "args", kwargs, f"nothing: {value} is not a function")
        else:
            raise invalid(owner, field, value, "a function returning examples or an iterable "
                          f"of them; it names a {type(obj).__name__}")
        return
    if not os.path.isfile(value):
        raise invalid(owner, field, value, "a JSONL file that exists, or an import path "
                      "'module:function' (no such file)")
    if not value.endswith(".jsonl"):
        raise invalid(owner, field, value, "a .jsonl file (one JSON object per line) or an "
                      "import path 'module:function'")
    unknown = sorted(set(kwargs) - set(_JSONL_ARGS))
    check(not unknown, owner, "args", kwargs, f"for a JSONL file only {list(_JSONL_ARGS)}; "
          f"unknown: {unknown}")


def _example(item: Any, where: str, prompt_key: str, answer_key: str) -> Example:
    if isinstance(item, Example):
        return item
    if isinstance(item, tuple | list) and len(item) == 2:
        return Example(prompt=str(item[0]), answer=str(item[1]))
    if isinstance(item, Mapping):
        for key in (prompt_key, answer_key):
            if key not in item:
                raise TaskError(f"{where}: no {key!r} key (keys: {sorted(item)}); name the "
                                "right one with args.prompt_key / args.answer_key")
        if not isinstance(item[prompt_key], str):
            raise TaskError(f"{where}: {prompt_key!r} is a {type(item[prompt_key]).__name__}, "
                            "not a string")
        metadata = {k: v for k, v in item.items() if k not in (prompt_key, answer_key)}
        return Example(prompt=item[prompt_key], answer=str(item[answer_key]), metadata=metadata)
    raise TaskError(f"{where}: a {type(item).__name__}; expected an Example, a mapping with "
                    f"{prompt_key!r} and {answer_key!r}, or a (prompt, answer) pair")


def load_examples(value: str, args: Mapping[str, Any] | None) -> list[Example]:
    """The examples of a source `check_source` accepted (at most MAX_EXAMPLES from a
    function); TaskError for bad data, naming the file and line."""
    kwargs = dict(args or {})
    if is_import_path(value):
        obj = import_object(value, owner="task", field="path")
        items = obj(**kwargs) if callable(obj) else obj
        if not isinstance(items, Iterable) or isinstance(items, str | bytes | Mapping):
            raise TaskError(f"{value} returned a {type(items).__name__}; expected an iterable "
                            "of examples")
        examples = [_example(item, f"{value} item {i}", "prompt", "answer")
                    for i, item in enumerate(itertools.islice(items, MAX_EXAMPLES))]
    else:
        prompt_key = kwargs.get("prompt_key", "prompt")
        answer_key = kwargs.get("answer_key", "answer")
        examples = []
        with open(value, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as error:
                    raise TaskError(f"{value}:{number}: not JSON ({error.msg})") from None
                examples.append(_example(item, f"{value}:{number}", prompt_key, answer_key))
    if not examples:
        raise TaskError(f"{value}: no examples")
    return examples


@dataclasses.dataclass(frozen=True, kw_only=True)
class CustomTask:
    """The `Task` protocol over a user's examples, split into training and held-out lists."""

    train: tuple[Example, ...]
    held_out: tuple[Example, ...]
    reward: Reward
    name: str = "custom"

    @classmethod
    def load(cls, path: str, args: Mapping[str, Any] | None = None, *,
             eval_path: str | None = None, eval_fraction: float = 0.1,
             reward: str | None = None, owner: str = "task") -> CustomTask:
        """The examples of `path` (and `eval_path`), split, with the reward at `reward`
        (None: exact match with the answer)."""
        examples = load_examples(path, args)
        if eval_path is not None:
            train, held_out = examples, load_examples(eval_path, args)
        else:
            train = [e for e in examples if split_of(e.prompt, eval_fraction) == "train"]
            held_out = [e for e in examples if split_of(e.prompt, eval_fraction) == "eval"]
        if not train or not held_out:
            empty = "training" if not train else "held-out"
            raise TaskError(f"{path}: the hash split at eval_fraction={eval_fraction} leaves "
                            f"no {empty} example among {len(examples)}; name a held-out file "
                            "with eval_path, or change eval_fraction")
        scorer = exact_match() if reward is None else load_reward(reward, owner=owner,
                                                                 field="reward")
        return cls(train=tuple(train), held_out=tuple(held_out), reward=scorer)

    def _examples(self, split: Split) -> tuple[Example, ...]:
        if split not in ("train", "eval"):
            raise ValueError(f"split = {split!r} is not valid; use 'train' or 'eval'")
        return self.train if split == "train" else self.held_out

    def sample(self, rng: random.Random) -> Example:
        return rng.choice(self.train)

    def iter_examples(self, split: Split, seed: int) -> Iterator[Example]:
        """Endless: the split's examples in a seeded order, reshuffled every pass."""
        examples = list(self._examples(split))
        rng = seeded_rng(self.name, split, seed)
        for epoch in itertools.count():
            rng.shuffle(examples)
            for k, example in enumerate(examples):
                yield dataclasses.replace(example, id=example.id or
                                          f"{self.name}/{split}/{seed}/{epoch}/{k}")

    def train_examples(self, n: int, seed: int = 0) -> list[Example]:
        return list(itertools.islice(self.iter_examples("train", seed), n))

    def eval_examples(self, n: int, seed: int = 0) -> list[Example]:
        if n > len(self.held_out):
            raise TaskError(f"the held-out split has {len(self.held_out)} examples, fewer than "
                            f"the {n} asked; lower num_eval, add eval data (eval_path) or "
                            "raise eval_fraction")
        return list(itertools.islice(self.iter_examples("eval", seed), n))

    def demonstration(self, example: Example) -> str:
        """The example's `demonstration` field when it has one, else its answer."""
        return str(example.metadata.get("demonstration", example.answer))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSource:
    """Where a user's prompts and answers come from (see the module docstring)."""

    path: str
    args: Any = None
    eval_path: str | None = None
    eval_fraction: float = 0.1

    def __post_init__(self) -> None:
        check_task_settings(self, owner="TaskSource")

    def load(self, reward: str | None = None, *, owner: str = "TaskSource") -> CustomTask:
        return CustomTask.load(self.path, self.args, eval_path=self.eval_path,
                               eval_fraction=self.eval_fraction, reward=reward, owner=owner)


def check_task_settings(settings: Any, *, owner: str) -> None:
    """The checks of a custom task's `path`, `args`, `eval_path`, `eval_fraction` and, when it
    has one, `reward` (for `TaskSource` and `nonstop rl`'s `task` section alike)."""
    check_source(settings.path, settings.args, owner=owner, field="path")
    if settings.eval_path is not None:
        check_source(settings.eval_path, settings.args, owner=owner, field="eval_path")
    check(isinstance(settings.eval_fraction, float) and 0.0 < settings.eval_fraction < 1.0,
          owner, "eval_fraction", settings.eval_fraction, "a number in (0, 1), exclusive")
    if getattr(settings, "reward", None) is not None:
        load_reward(settings.reward, owner=owner, field="reward")


def custom_task(settings: Any) -> CustomTask:
    """The task `nonstop rl`'s `task` section describes when `name: custom`."""
    return CustomTask.load(settings.path, settings.args, eval_path=settings.eval_path,
                           eval_fraction=settings.eval_fraction, reward=settings.reward)


__all__ = ["MAX_EXAMPLES", "CustomTask", "TaskSource", "check_source", "check_task_settings",
           "custom_task", "load_examples"]
