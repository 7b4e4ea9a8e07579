"""`nonstop agentic` on a user's environment, or on a user's tools, reward and tasks.

    env:                                      # an Environment of one's own
      path: "my_pkg.envs:MyEnv"
      args: {difficulty: 3}
    env:                                      # or plain functions and a task file
      tools: ["my_pkg.tools:search"]
      reward: "my_pkg.rewards:score"
      tasks: {path: data/questions.jsonl}     # nonstop.recipes.tasks.custom.TaskSource
      system_prompt: "Search, then answer in one line."

`check_custom_env` runs in `EnvSettings.__post_init__`: every path is imported and checked then,
so a mistake stops the config from loading. `make_custom_env` builds one episode's environment.
An environment named by `path` draws its own tasks from the seeds it is given (training groups
from `seed`, held-out ones from `EVAL_SEED_OFFSET`); a tools environment answers group g of the
training run with the g-th example of its shuffled training split, and held-out episode i with
the i-th held-out example.
"""

from __future__ import annotations

import functools
import random
from typing import Any

from nonstop.agentic.environment import Environment
from nonstop.agentic.plugins import (
    FunctionToolEnv,
    FunctionTools,
    build_environment,
    check_environment,
    import_object,
    load_reward,
    load_tool,
)
from nonstop.models.validation import check
from nonstop.recipes.tasks.custom import CustomTask
from nonstop.rl.rewards import Example

OWNER = "EnvSettings"


def uses_custom_env(cfg: Any) -> bool:
    """Whether `cfg` (an EnvSettings) names a user's environment or tools."""
    return cfg.path is not None or bool(cfg.tools)


def check_custom_env(cfg: Any) -> None:
    """Import and check every path `cfg` names; a ConfigError naming the key otherwise."""
    check(cfg.args is None or isinstance(cfg.args, dict), OWNER, "args", cfg.args,
          "a mapping of keyword arguments for env.path (or null)")
    if cfg.path is not None:
        for key in ("tools", "reward", "tasks", "system_prompt"):
            value = getattr(cfg, key)
            check(not value, OWNER, key, value, f"unset: env.path={cfg.path!r} names an "
                  "environment that brings its own tools, reward, tasks and prompt")
        check_environment(import_object(cfg.path, owner=OWNER, field="path"), cfg.args or {},
                          owner=OWNER, field="path", value=cfg.path)
        return
    check(cfg.args is None, OWNER, "args", cfg.args, "unset without env.path (tools take no "
          "arguments; a task function's go under env.tasks.args)")
    if not cfg.tools:
        for key in ("reward", "tasks", "system_prompt"):
            check(not getattr(cfg, key), OWNER, key, getattr(cfg, key),
                  "unset without env.tools (or with env.path instead)")
        return
    names = [load_tool(path, owner=OWNER, field=f"tools[{i}]").name
             for i, path in enumerate(cfg.tools)]
    twice = sorted({n for n in names if names.count(n) > 1})
    check(not twice, OWNER, "tools", cfg.tools, f"tools with distinct names; {twice} repeat")
    check(cfg.reward is not None, OWNER, "reward", cfg.reward, "an import path 'module:function' "
          "of the reward (prompt, completion, example) -> float that scores the final answer")
    load_reward(cfg.reward, owner=OWNER, field="reward")
    check(cfg.tasks is not None, OWNER, "tasks", cfg.tasks, "the prompts and answers, e.g. "
          "env.tasks.path=data/questions.jsonl (or a 'module:function' yielding them)")


@functools.lru_cache(maxsize=8)
def _tool_parts(tools: tuple[str, ...], reward: str, system_prompt: str | None,
                max_turns: int) -> FunctionTools:
    return FunctionTools(
        tools=tuple(load_tool(p, owner=OWNER, field="tools") for p in tools),
        reward=load_reward(reward, owner=OWNER, field="reward"), system_prompt=system_prompt,
        max_turns=max_turns)


@functools.lru_cache(maxsize=8)
def _task_split(path: str, args_items: tuple, eval_path: str | None,
                eval_fraction: float) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    task = CustomTask.load(path, dict(args_items) or None, eval_path=eval_path,
                           eval_fraction=eval_fraction, owner=OWNER)
    train = list(task.train)
    random.Random(f"custom/{path}").shuffle(train)
    return tuple(train), task.held_out


def _hashable(args: Any) -> tuple:
    return tuple(sorted((args or {}).items(), key=lambda kv: kv[0]))


def make_custom_env(cfg: Any, *, eval_seed_offset: int, max_turns: int = 8) -> Environment:
    """One episode's environment for `cfg` (an EnvSettings with `uses_custom_env`)."""
    if cfg.path is not None:
        obj = import_object(cfg.path, owner=OWNER, field="path")
        return build_environment(obj, cfg.args or {}, owner=OWNER, field="path",
                                 value=cfg.path)
    source = cfg.tasks
    try:
        train, held_out = _task_split(source.path, _hashable(source.args), source.eval_path,
                                      source.eval_fraction)
    except TypeError:  # unhashable argument values: load without the cache
        task = source.load(owner=OWNER)
        train, held_out = task.train, task.held_out

    def task_for_seed(seed: int) -> Example:
        if seed >= eval_seed_offset:
            return held_out[(seed - eval_seed_offset) % len(held_out)]
        return train[seed % len(train)]

    parts = _tool_parts(tuple(cfg.tools), cfg.reward, cfg.system_prompt, max_turns)
    return FunctionToolEnv(parts, task_for_seed)


__all__ = ["check_custom_env", "make_custom_env", "uses_custom_env"]
