"""Weight updates between device steps: "continue" and "abort" modes, versions, no recompiles."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from flax import nnx

from nonstop.engine import Engine, EngineConfig, SamplingParams
from nonstop.models import ModelConfig, init_decoder
from tests.engine.engine_fixtures import record_compiles

MAX_LEN = 96
CFG = ModelConfig.tiny("qwen3")


def _model(seed):
    m = init_decoder(CFG, seed=seed)
    nnx.update(m, jax.tree.map(lambda x: x * 25.0 if x.ndim > 1 else x, nnx.state(m)))
    return m


@pytest.fixture(scope="module")
def models():
    return _model(1), _model(2)


def _prompt(n, seed=0):
    return np.random.RandomState(seed).randint(3, 257, n).tolist()


def _wait_for_tokens(engine, n):
    while engine.stats().generated_tokens < n:
        threading.Event().wait(0.0005)


def _greedy(engine, prompt, n):
    return engine.generate_sync(prompt, SamplingParams(temperature=0.0, max_tokens=n))


@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("mode", ["continue", "abort"])
def test_update_weights_mid_flight(models, mode, layout):
    a, b = models
    with Engine(b, EngineConfig(max_slots=2, max_len=MAX_LEN, prefill_chunks=(16,))) as on_b:
        expected_b = _greedy(on_b, _prompt(5), 80).tokens
    with Engine(a, EngineConfig(max_slots=2, max_len=MAX_LEN, prefill_chunks=(16,),
                                on_weight_update=mode, kv_layout=layout)) as engine:
        expected_a = _greedy(engine, _prompt(5), 80).tokens
        assert expected_a != expected_b
        traces = engine.stats().traces
        compiles = record_compiles()
        start = engine.stats().generated_tokens
        future = engine.submit(_prompt(5), SamplingParams(temperature=0.0, max_tokens=80))
        _wait_for_tokens(engine, start + 3)
        engine.update_weights(nnx.state(b), version=7)
        c = future.result(timeout=60)
        after = _greedy(engine, _prompt(5), 80)
        assert engine.policy_version == 7
        assert engine.stats().traces == traces
    assert compiles == []  # neither the swap nor the new weights compiled anything
    assert after.tokens == expected_b and set(after.policy_versions) == {7}
    if mode == "continue":
        versions = list(c.policy_versions)
        assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 7
        n_old = versions.count(0)
        assert 3 <= n_old < 80 and c.tokens[:n_old] == expected_a[:n_old]
    else:
        assert c.tokens == expected_b and set(c.policy_versions) == {7}


def test_update_weights_checks_shapes_and_dtypes(models):
    a, _ = models
    engine = Engine(a, EngineConfig(max_slots=1, max_len=16))
    other = init_decoder(ModelConfig.tiny("qwen3", intermediate_size=59), seed=0)
    with pytest.raises(ValueError, match="structure|mlp"):
        engine.update_weights(nnx.state(other), version=1)
    halved = jax.tree.map(lambda x: x.astype("bfloat16"), nnx.state(a))
    with pytest.raises(ValueError, match="dtypes must match"):
        engine.update_weights(halved, version=1)
    assert not engine.running
