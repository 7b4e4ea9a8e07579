"""Adapters that run environments from the hubs people already use in nonstop's orchestrator.

- `verifiers_env.VerifiersEnv`: a `verifiers` (PyPI `verifiers`) Taskset, its tools and rubric;
- `openenv_env.OpenEnvEnv`: an OpenEnv (PyPI `openenv-core`) Environment, its actions, MCP tools
  and rewards.

Each is a nonstop `Environment`, selected like any user environment:

    env: {path: "nonstop.agentic.hubs.verifiers_env:VerifiersEnv",
          args: {taskset: "my_pkg.envs:MathTaskset"}}

The libraries are optional (`pip install nonstop[hubs]`); importing an adapter without its library
says what to install. This package imports neither until an adapter is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

_ADAPTERS = {"VerifiersEnv": ("verifiers_env", "verifiers"),
             "OpenEnvEnv": ("openenv_env", "openenv-core")}


def __getattr__(name: str) -> Any:
    if name not in _ADAPTERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, package = _ADAPTERS[name]
    try:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    except ImportError as error:
        raise ImportError(f"{name} needs the `{package}` package (pip install 'nonstop[hubs]'): "
                          f"{error}") from error


__all__ = ["OpenEnvEnv", "VerifiersEnv"]
