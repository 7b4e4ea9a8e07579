"""Several decode steps per device call (`EngineConfig.decode_steps_per_call`) and several
calls in flight (`EngineConfig.pipeline_depth`): an engine running K steps a call, or running
further ahead of the host, gives the tokens, finish reasons and log-probabilities of one
running a step a call two deep, through stop tokens, `max_tokens`, a full cache and a session's
second turn; what a call computes past a request's end is counted as dropped, by hand; and
nothing compiles after warm-up."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from nonstop.engine import Engine, SamplingParams
from nonstop.engine.config import EngineConfig
from nonstop.models.validation import ConfigError
from tests.engine.engine_fixtures import random_prompt, sharp_tiny_model

MAX_LEN = 64


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model(seed=5)


STOP_IDS = tuple(range(3, 40))  # ~15% of the vocabulary: sampled runs hit one within a few tokens


def _requests():
    out = []
    for i in range(10):
        params = SamplingParams(temperature=[0.0, 1.0, 0.8][i % 3], top_k=[0, 0, 20][i % 3],
                                max_tokens=[5, 7, 11, 2, None][i % 5], seed=i,
                                stop_token_ids=STOP_IDS if i % 2 else ())
        out.append((random_prompt(3 + 5 * i, seed=i), params))
    # Runs into the end of the cache: 60 prompt tokens, no max_tokens, no stop.
    out.append((random_prompt(60, seed=99), SamplingParams(temperature=1.0, seed=99)))
    return out


def _run(model, k, depth=2, layout="dense"):
    with Engine(model, EngineConfig(max_slots=4, max_len=MAX_LEN, prefill_chunks=(8, 32),
                                    decode_buckets=2, decode_steps_per_call=k,
                                    pipeline_depth=depth, kv_layout=layout,
                                    block_size=7)) as engine:
        traces = engine.stats().traces

        async def episode(seed):
            # Two turns in one session: the second continues the first's cache, whose slot
            # holds whatever a call computed past the first turn's stop.
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=9,
                                    stop_token_ids=STOP_IDS)
            with engine.session() as s:
                prompt = random_prompt(6, seed=seed)
                first = await engine.generate(prompt, params, session=s)
                context = prompt + list(first.tokens) + random_prompt(3, seed=seed + 1)
                second = await engine.generate(context, params, session=s)
            return [first, second]

        async def main():
            singles = [engine.generate(p, s) for p, s in _requests()]
            sessions = [episode(100 + i) for i in range(3)]
            return await asyncio.gather(*singles, *sessions)

        results = asyncio.run(main())
        stats = engine.stats()
        assert stats.traces == traces  # every variant was compiled at warm-up
    flat = []
    for r in results:
        flat.extend(r if isinstance(r, list) else [r])
    return flat, stats


def test_k_steps_per_call_give_the_tokens_of_one_step_per_call(model):
    single, single_stats = _run(model, 1)
    multi, stats = _run(model, 3)
    reasons = [c.finish_reason for c in single]
    # The cases this test is about all occur.
    assert {"stop", "length", "cache_full"} <= set(reasons)
    assert any(c.finish_reason == "stop" and len(c.tokens) % 3 for c in single)
    assert [c.finish_reason for c in multi] == reasons
    for a, b in zip(single, multi, strict=True):
        assert a.tokens == b.tokens
        assert a.policy_versions == b.policy_versions
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        np.testing.assert_allclose(a.sampling_logprobs, b.sampling_logprobs, atol=1e-5)
    assert stats.generated_tokens == single_stats.generated_tokens
    assert stats.decode_steps == 3 * stats.decode_calls
    assert single_stats.decode_steps == single_stats.decode_calls
    assert stats.decode_calls < single_stats.decode_calls / 2
    assert sorted(k for k in stats.traces if k.startswith("decode")) == [
        "decode_3x32", "decode_3x64"]
    # The paged layout (blocks of 7: they straddle the 32-position attention bucket), with
    # sessions and requests running into the end of the cache, gives the same results.
    paged, _ = _run(model, 3, layout="paged")
    for a, b in zip(single, paged, strict=True):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.parametrize("depth", [1, 3])
def test_pipeline_depth_gives_the_tokens_of_two_deep(model, depth):
    two, two_stats = _run(model, 1)
    other, stats = _run(model, 1, depth)
    assert {"stop", "length", "cache_full"} <= {c.finish_reason for c in two}
    for a, b in zip(two, other, strict=True):
        assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
        assert a.policy_versions == b.policy_versions
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert stats.generated_tokens == two_stats.generated_tokens
    # Past a stop, depth 1 computes only the step launched with the prompt's last chunk (when
    # the prefill's own token stops); depth 3 computes a step more than 2 does.
    assert (stats.dropped_tokens < two_stats.dropped_tokens) if depth == 1 else (
        stats.dropped_tokens > two_stats.dropped_tokens)


def _lone_request(model, k, depth, params):
    with Engine(model, EngineConfig(max_slots=2, max_len=MAX_LEN, prefill_chunks=(8,), decode_steps_per_call=k, pipeline_depth=depth)) as engine:
        out = engine.generate_sync(random_prompt(4, seed=1), params)
        # Every call is launched before the request resolves; the last ones are read back
        # (their tokens dropped) just after: wait until each token computed is accounted for.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = engine.stats()
            if stats.generated_tokens - 1 + stats.dropped_tokens >= stats.decode_steps:
                break
            time.sleep(0.01)
        return out, stats


@pytest.mark.parametrize(("k", "depth", "max_tokens", "calls"),
                         [(1, 2, 5, 4), (1, 3, 5, 4), (4, 2, 5, 1), (4, 3, 5, 1), (3, 2, 5, 2),
                          (1, 2, 1, 0), (4, 3, 1, 0)])
def test_a_lone_request_to_max_tokens_costs_the_calls_counted_by_hand(model, k, depth,
                                                                      max_tokens, calls):
    # max_tokens 5: prefill samples token 1, decode calls sample the other 4, and the call
    # sampling token 5 is the last one the request is in, at any depth. K = 1: 4 calls. K = 4:
    # tokens 2-5 in one call. K = 3: tokens 2-4, then 5-7 of which 6 and 7 are dropped.
    # max_tokens 1: the prefill samples the only token; no decode call at all.
    out, stats = _lone_request(model, k, depth, SamplingParams(temperature=0.0,
                                                               max_tokens=max_tokens))
    assert len(out.tokens) == max_tokens and out.finish_reason == "length"
    assert (stats.decode_calls, stats.decode_steps) == (calls, calls * k)
    assert stats.dropped_tokens == calls * k + 1 - max_tokens
    assert stats.generated_tokens == max_tokens


@pytest.mark.parametrize(("k", "depth"), [(1, 1), (1, 2), (1, 3), (3, 2), (3, 3)])
def test_a_lone_request_to_a_stop_token_costs_the_calls_counted_by_hand(model, k, depth):
    free, _ = _lone_request(model, 1, 2, SamplingParams(temperature=0.0, max_tokens=12))
    # Stop at the first token (after the prefill's) not seen before it: token t + 1 of the
    # request, sampled by step t, in call ceil(t / K). The host learns of the stop when that
    # call is read back, after launching the depth - 1 calls after it, all dropped; so are the
    # steps of its own call after the stop.
    t = next(i for i in range(1, 12) if free.tokens[i] not in free.tokens[:i])
    out, stats = _lone_request(model, k, depth, SamplingParams(
        temperature=0.0, max_tokens=12, stop_token_ids=(free.tokens[t],)))
    assert out.tokens == free.tokens[:t + 1] and out.finish_reason == "stop"
    stop_call = -(-t // k)
    assert stats.decode_calls == stop_call + depth - 1
    assert stats.dropped_tokens == stats.decode_calls * k - t
    assert stats.generated_tokens == t + 1


def test_decode_steps_per_call_is_validated():
    assert EngineConfig(decode_steps_per_call=4).decode_steps_per_call == 4
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match="decode_steps_per_call="):
            EngineConfig(decode_steps_per_call=bad)
    assert EngineConfig(pipeline_depth=3).pipeline_depth == 3
    for bad in (0, 2.5, False):
        with pytest.raises(ConfigError, match="pipeline_depth="):
            EngineConfig(pipeline_depth=bad)
