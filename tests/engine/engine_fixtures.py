"""Shared builders for engine tests: a tiny model with decisive logits and seeded prompts."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from nonstop.models import ModelConfig, init_decoder

# What a test counts as a compilation: an XLA compile, or a program loaded from the persistent
# compilation cache the suite runs with (tests/conftest.py).
COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration",
                  "/jax/compilation_cache/cache_retrieval_time_sec")


def record_compiles() -> list[str]:
    """A list that every compilation of this process appends its event name to, from now on."""
    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if event in COMPILE_EVENTS else None)
    return compiles


def sharp_tiny_model(seed: int):
    """A tiny Qwen3 decoder whose weights are scaled up: random init at std 0.02 gives
    near-uniform logits, and scaled ones leave greedy decoding no near-ties."""
    m = init_decoder(ModelConfig.tiny("qwen3"), seed=seed)
    nnx.update(m, jax.tree.map(lambda x: x * 25.0 if x.ndim > 1 else x, nnx.state(m)))
    return m


def random_prompt(n: int, seed: int) -> list[int]:
    return np.random.RandomState(seed).randint(3, 250, n).tolist()
