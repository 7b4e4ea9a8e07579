"""Host swap of idle sessions' blocks on the paged layout (`EngineConfig.swap_space_gib` with
kv_layout "paged"): when the pool runs short, the least recently used idle session's blocks are
copied to the host before they are freed, and its next turn gets new blocks with the copy
written back, so it prefills only its new tokens. Every result is compared with a dense run
that has room for everything; the budget, the prefix cache and weight updates are exercised."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from nonstop.engine import Engine, EngineConfig, SamplingParams
from tests.engine.engine_fixtures import random_prompt, sharp_tiny_model

MAX_LEN = 64
BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
CONTEXTS = [random_prompt(9 + i, seed=60 + i) for i in range(6)]
TOOL = [3, 4]


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model(seed=7)


@pytest.fixture(scope="module")
def reference(model):
    """Both turns of every context on a dense engine with a slot each (nothing evicted)."""
    with Engine(model, EngineConfig(max_slots=6, max_len=MAX_LEN,
                                    prefill_chunks=(8, 32))) as dense:
        first = [dense.generate_sync(c, GREEDY) for c in CONTEXTS]
        second = [dense.generate_sync(c + list(f.tokens) + TOOL, GREEDY)
                  for c, f in zip(CONTEXTS, first, strict=True)]
    return first, second


def _paged(**overrides):
    # Room for about two sessions' contexts: the others' blocks must go.
    base = dict(max_slots=2, max_len=MAX_LEN, prefill_chunks=(8, 32), kv_layout="paged",
                block_size=BS, kv_cache_tokens=MAX_LEN + 16, prefix_cache=False)
    return EngineConfig(**{**base, **overrides})


def _two_turns(engine):
    sessions = [engine.session() for _ in CONTEXTS]
    first = [engine.generate_sync(c, GREEDY, session=s)
             for c, s in zip(CONTEXTS, sessions, strict=True)]
    second = [engine.generate_sync(c + list(f.tokens) + TOOL, GREEDY, session=s)
              for c, f, s in zip(CONTEXTS, first, sessions, strict=True)]
    return sessions, first, second


def _assert_same(results, expected):
    assert [r.tokens for r in results] == [r.tokens for r in expected]
    for a, b in zip(results, expected, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_swapped_sessions_prefill_only_their_new_tokens(model, reference):
    config = _paged(swap_space_gib=0.01)
    with Engine(model, config) as engine:
        warm = dict(engine.stats().traces)
        sessions, first, second = _two_turns(engine)
        stats = engine.stats()
        for s in sessions:
            s.close()
        _assert_same(first, reference[0])
        _assert_same(second, reference[1])
        assert stats.evictions > 0 and stats.swapped_out > 0 and stats.swapped_in > 0
        assert stats.swap_dropped == 0
        # Every second turn found its whole first turn (prompt and the tokens fed back), in
        # kept or swapped-in blocks: only the two tool tokens and the last sampled token are
        # computed.
        assert [r.num_cached for r in second] == [len(c) + 4 for c in CONTEXTS]
        assert stats.traces == warm  # the block copies compiled at warm-up
        engine.generate_sync(CONTEXTS[0], GREEDY)  # the closes went through before this
        assert engine.stats().free_blocks == config.num_blocks
    # Without swapping the same pool recomputes the evicted sessions' contexts.
    with Engine(model, _paged()) as engine:
        _, _, recomputed = _two_turns(engine)
        assert engine.stats().swapped_out == 0
    assert sum(r.num_prefilled for r in recomputed) > sum(r.num_prefilled for r in second)
    _assert_same(recomputed, reference[1])


def test_a_small_budget_drops_the_oldest_copies_and_results_stay_exact(model, reference):
    # One block of this model is 2 layers x 2 (keys, values) x 2 heads x 4 positions x 8
    # dims x 4 bytes = 1 KiB; 4 KiB holds one short session's copy (4 blocks), no more.
    with Engine(model, _paged(swap_space_gib=4 / 2**20)) as engine:
        assert engine._device.block_bytes() == 1024
        sessions, first, second = _two_turns(engine)
        stats = engine.stats()
        for s in sessions:
            s.close()
    assert stats.swap_dropped > 0 and stats.swapped_in > 0
    assert any(r.num_cached == 0 for r in second)  # a dropped copy: recomputed
    _assert_same(first, reference[0])
    _assert_same(second, reference[1])


def test_a_copy_swapped_in_after_a_weight_update_is_used_but_never_keyed(model):
    """In "continue" mode a session's next turn goes on from its kept keys and values (as on
    the dense layout), swapped or not; but blocks computed by older weights never enter the
    prefix cache, so a new request with the same prefix finds nothing."""
    other = sharp_tiny_model(seed=8)
    config = _paged(swap_space_gib=0.01, prefix_cache=True)
    with Engine(model, config) as engine:
        sessions, first, _ = _two_turns(engine)  # leaves copies on the host
        assert engine.stats().swapped_out > 0
        engine.update_weights(nnx.state(other), version=1)
        swapped_in = engine.stats().swapped_in
        s = sessions[1]  # evicted by the sessions after it: on the host
        context = CONTEXTS[1] + list(first[1].tokens) + TOOL
        turn = engine.generate_sync(context + [9, 9], GREEDY, session=s)
        assert engine.stats().swapped_in == swapped_in + 1 and turn.num_cached > 0
        s.close()
        fresh = engine.generate_sync(context + [9, 9], GREEDY)
        assert fresh.num_cached == 0
        for s in sessions:
            s.close()
