"""Prefill of several prompts in one device call (`EngineConfig.prefill_rows`): the compiled row
counts, one batched call against the same rows one at a time (cache and first tokens), which
waiting prompts the scheduler puts together, and a whole engine against one that prefills
prompts one by one."""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest

from nonstop.engine import Engine, SamplingParams
from nonstop.engine.config import EngineConfig
from nonstop.engine.device import DeviceSteps, idle_sampling
from nonstop.engine.requests import Request
from nonstop.engine.scheduler import Scheduler
from nonstop.models.validation import ConfigError
from tests.engine.engine_fixtures import random_prompt, sharp_tiny_model

MAX_LEN = 64


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model(seed=4)


def test_prefill_row_counts_are_powers_of_two_up_to_the_setting():
    assert EngineConfig(prefill_rows=1).prefill_row_counts == (1,)
    assert EngineConfig(max_slots=32, prefill_rows=8).prefill_row_counts == (1, 2, 4, 8)
    assert EngineConfig(max_slots=32, prefill_rows=6).prefill_row_counts == (1, 2, 4, 6)
    assert EngineConfig(max_slots=3, prefill_rows=8).prefill_row_counts == (1, 2, 3)
    assert EngineConfig(max_slots=32, prefill_rows=8).prefill_row_count(3) == 4
    with pytest.raises(ConfigError, match="prefill_rows=0 is invalid"):
        EngineConfig(prefill_rows=0)


def test_one_call_of_several_rows_equals_the_rows_one_at_a_time(model):
    device = DeviceSteps(model, num_slots=4, max_len=MAX_LEN)
    state = device.initial_state
    # Slot 3 already holds 4 positions of its prompt; the call continues it at position 4.
    head = np.zeros((1, 8), np.int32)
    head[0, :4] = random_prompt(4, seed=9)
    rows = [(2, 0, random_prompt(5, seed=1)), (0, 0, random_prompt(8, seed=2)), (3, 4, random_prompt(3, seed=3))]

    def start():
        cache, _ = device.prefill(state, device.new_cache(), head, [0], [4], [3],
                                  idle_sampling(1))
        return cache

    singles, cache = [], start()
    for slot, pos, tokens in rows:
        chunk = np.zeros((1, 8), np.int32)
        chunk[0, :len(tokens)] = tokens
        cache, out = device.prefill(state, cache, chunk, [pos], [len(tokens)], [slot],
                                    idle_sampling(1))
        singles.append(jax.device_get(out))
    batch = np.zeros((4, 8), np.int32)  # three rows and one padding row (length 0)
    for r, (_, _, tokens) in enumerate(rows):
        batch[r, :len(tokens)] = tokens
    batched, out = device.prefill(state, start(), batch, [0, 0, 4, MAX_LEN], [5, 8, 3, 0],
                                  [2, 0, 3, 1], idle_sampling(4))
    out = jax.device_get(out)
    for r, single in enumerate(singles):
        assert out.tokens[r] == single.tokens[0]  # greedy
        np.testing.assert_allclose(out.logprobs[r], single.logprobs[0], atol=1e-5)
    for a, b in zip(jax.tree.leaves(batched), jax.tree.leaves(cache), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, atol=1e-5)
        assert not a[1].any()  # the padding row (slot 1) wrote nothing
        assert np.array_equal(a[3, :, :4], b[3, :, :4])  # slot 3's earlier positions kept


def test_the_scheduler_puts_waiting_prompts_with_equal_chunks_together(model):
    config = EngineConfig(max_slots=6, max_len=MAX_LEN, prefill_chunks=(8, 32), prefill_rows=4)
    device = DeviceSteps(model, num_slots=6, max_len=MAX_LEN)
    scheduler = Scheduler(device, device.initial_state, 0, config, None)  # driven by hand
    done = {}
    lengths = [5, 20, 6, 7, 30, 3]  # next chunk: 8, 32, 8, 8, 32, 8
    for i, n in enumerate(lengths):
        scheduler._accept(Request(
            prompt=random_prompt(n, seed=i), temperature=0.0, top_k=0, top_p=1.0, seed=i,
            max_tokens=1, stop_ids=frozenset(), stop=(), session=None,
            resolve=lambda result, i=i: done.__setitem__(i, result)))
    scheduler._admit()
    assert list(scheduler.prefilling) == [0, 1, 2, 3, 4, 5] and not scheduler.waiting

    def lengths_of(rows):
        return [len(req.prompt) for _, req, _ in rows]

    # The oldest prompt's chunk length (8) decides; up to 4 rows, in arrival order.
    assert lengths_of(scheduler._next_prefill_rows()) == [5, 6, 7, 3]
    scheduler._prefill_some()
    assert scheduler.counters.prefill_calls == 2 and scheduler.counters.prefill_chunks == 6
    assert not scheduler.prefilling and not done  # launched, not read back
    scheduler._decode_step()  # launches a step, then reads back the two prefills before it
    assert sorted(done) == list(range(6))
    with Engine(model, EngineConfig(max_slots=1, max_len=MAX_LEN, prefill_chunks=(8, 32))) as one_by_one:
        for i, n in enumerate(lengths):
            expected = one_by_one.generate_sync(random_prompt(n, seed=i),
                                                SamplingParams(temperature=0.0, max_tokens=1))
            assert done[i].tokens == expected.tokens
            np.testing.assert_allclose(done[i].logprobs, expected.logprobs, atol=1e-5)


def test_an_engine_prefilling_rows_together_matches_one_prefilling_one_by_one(model):
    requests = [(random_prompt(2 + 9 * i % 41, seed=i), SamplingParams(temperature=t, max_tokens=5,
                                                                 seed=i))
                for i, t in zip(range(12), [0.0, 1.0] * 6, strict=True)]

    def run(rows, layout="dense"):
        with Engine(model, EngineConfig(max_slots=8, max_len=MAX_LEN, prefill_chunks=(8, 32),
                                        prefill_rows=rows, kv_layout=layout)) as engine:
            traces = engine.stats().traces

            async def main():
                return await asyncio.gather(*(engine.generate(p, s) for p, s in requests))

            results = asyncio.run(main())
            stats = engine.stats()
            assert stats.traces == traces  # every row count was compiled at warm-up
            return results, stats

    alone, alone_stats = run(1)
    together, stats = run(8)
    paged, _ = run(8, "paged")
    assert [r.tokens for r in paged] == [r.tokens for r in alone]
    assert alone_stats.prefill_calls == alone_stats.prefill_chunks
    assert stats.prefill_chunks == alone_stats.prefill_chunks
    assert sorted(k for k in stats.traces if k.startswith("prefill")) == [
        "prefill_2x32", "prefill_2x8", "prefill_32", "prefill_4x32", "prefill_4x8",
        "prefill_8", "prefill_8x32", "prefill_8x8"]
    for a, b in zip(alone, together, strict=True):
        assert a.tokens == b.tokens  # the same samples: each row keeps its own seed
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
