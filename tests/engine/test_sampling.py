"""The on-device sampler on hand-worked inputs, and SamplingParams validation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nonstop.engine import RequestError, SamplingParams
from nonstop.engine.sampling import filter_logits, sample, seed32

_sample = jax.jit(sample)


def _rows(n, **values):
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, seed=0, step=0)
    defaults.update(values)
    return (jnp.full(n, defaults["temperature"], jnp.float32), jnp.full(n, defaults["top_k"], jnp.int32),
            jnp.full(n, defaults["top_p"], jnp.float32), jnp.full(n, defaults["seed"], jnp.uint32),
            jnp.full(n, defaults["step"], jnp.int32))


def test_filter_top_k_and_top_p_by_hand():
    # probabilities 0.4, 0.3, 0.2, 0.1 over tokens 0..3, shuffled order to test the sort.
    probs = np.array([0.2, 0.4, 0.1, 0.3])
    logits = jnp.asarray(np.log(probs)[None].repeat(4, 0), jnp.float32)
    top_k = jnp.array([2, 0, 0, 3], jnp.int32)
    top_p = jnp.array([1.0, 0.5, 0.71, 0.6], jnp.float32)
    kept = np.isfinite(np.asarray(filter_logits(logits, top_k, top_p)))
    # row 0: top-2 -> tokens 1 (0.4), 3 (0.3)
    # row 1: p=0.5: 0.4 < 0.5, so 0.4 + 0.3 -> tokens 1, 3
    # row 2: p=0.71: mass before 0.2 is 0.7 < 0.71 -> tokens 1, 3, 0
    # row 3: top-3 renormalised: 0.4/.9=.444, .3/.9=.333 -> mass before the 3rd is .778 >= .6
    expected = np.array([[0, 1, 0, 1], [0, 1, 0, 1], [1, 1, 0, 1], [0, 1, 0, 1]], bool)
    np.testing.assert_array_equal(kept, expected)


def test_filter_keeps_the_top_token_even_for_tiny_top_p():
    logits = jnp.asarray([[0.0, 3.0, 1.0]], jnp.float32)
    kept = np.isfinite(np.asarray(filter_logits(logits, jnp.array([0]), jnp.array([1e-6]))))
    np.testing.assert_array_equal(kept, [[False, True, False]])


def test_greedy_rows_take_the_argmax_and_report_raw_logprobs():
    logits = jnp.asarray([[1.0, 4.0, 2.0], [0.5, 0.1, 0.2]], jnp.float32)
    tokens, logprobs, sampling_lp = _sample(logits, *_rows(2, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(tokens), [1, 0])
    expected = np.asarray(jax.nn.log_softmax(logits))[[0, 1], [1, 0]]
    np.testing.assert_allclose(np.asarray(logprobs), expected, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(sampling_lp), [0.0, 0.0])


def test_logprob_ignores_temperature_and_filters_but_sampling_logprob_does_not():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]], jnp.float32)
    temperature, top_k = 0.5, 2
    tokens, logprobs, sampling_lp = _sample(logits, *_rows(1, temperature=temperature,
                                                           top_k=top_k, seed=7))
    t = int(tokens[0])
    assert t in (0, 1)
    raw = np.asarray(jax.nn.log_softmax(logits[0]))
    np.testing.assert_allclose(float(logprobs[0]), raw[t], atol=1e-6)
    scaled = np.array([2.0, 1.0]) / temperature
    expected = scaled[t] - np.log(np.exp(scaled).sum())
    np.testing.assert_allclose(float(sampling_lp[0]), expected, atol=1e-5)


def test_draws_follow_the_distribution_and_depend_only_on_seed_and_step():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = jnp.asarray(np.log(probs)[None].repeat(n, 0), jnp.float32)
    seeds = jnp.arange(n, dtype=jnp.uint32)
    args = (jnp.ones(n), jnp.zeros(n, jnp.int32), jnp.ones(n), seeds, jnp.zeros(n, jnp.int32))
    tokens = np.asarray(_sample(logits, *args)[0])
    freq = np.bincount(tokens, minlength=4) / n
    np.testing.assert_allclose(freq, probs, atol=0.03)  # ~4 standard errors
    # The same (seed, step) in another row, in a different batch, draws the same token.
    again = _sample(logits[:3], jnp.ones(3), jnp.zeros(3, jnp.int32), jnp.ones(3),
                    seeds[jnp.array([10, 0, 5])], jnp.zeros(3, jnp.int32))[0]
    np.testing.assert_array_equal(np.asarray(again), tokens[[10, 0, 5]])
    next_step = _sample(logits, *args[:4], jnp.ones(n, jnp.int32))[0]
    assert np.mean(np.asarray(next_step) != tokens) > 0.3


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(stop_token_ids=(-3,)), "stop_token_ids"),
    (dict(stop=("",)), "stop"), (dict(seed=1.5), "seed"),
])
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(RequestError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError):  # RequestError is a ValueError too
        SamplingParams(**kwargs)


def test_sampling_params_normalises_sequences():
    p = SamplingParams(stop="END", stop_token_ids=[2, 5])
    assert p.stop == ("END",) and p.stop_token_ids == (2, 5)
    assert seed32(-1) == 2**32 - 1 and seed32(5) == 5
