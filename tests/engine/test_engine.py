"""The engine's behaviour: concurrency, cancellation, stops, limits, bad input, seeds, sessions,
and no compilation after warm-up. One tiny Llama engine (3 slots, evicted sessions swapped to the
host) is shared by the module."""

from __future__ import annotations

import asyncio
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nonstop import perf
from nonstop.engine import Engine, EngineConfig, EngineError, RequestError, SamplingParams
from nonstop.engine.requests import Session
from nonstop.models import ModelConfig, init_decoder
from tests.engine.engine_fixtures import record_compiles

MAX_LEN = 64
SLOTS = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


class LetterTokenizer:
    """A real (if small) detokenizer: token id i is the letter 'a' + i % 26."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.fixture(scope="module")
def model():
    m = init_decoder(ModelConfig.tiny("llama"), seed=5)
    # Random init at std 0.02 gives near-uniform logits; scale up so greedy has no near-ties.
    nnx.update(m, jax.tree.map(lambda x: x * 25.0 if x.ndim > 1 else x, nnx.state(m)))
    return m


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model, EngineConfig(max_slots=SLOTS, max_len=MAX_LEN, prefill_chunks=(8, 32), swap_space_gib=0.01), tokenizer=LetterTokenizer()) as e:
        yield e


def _prompt(n, seed=0):
    return np.random.RandomState(seed).randint(3, 257, n).tolist()


def _gather(*coros):
    async def main():
        return await asyncio.gather(*coros, return_exceptions=True)
    return asyncio.run(main())


def test_concurrent_generate_calls_equal_sequential_ones(engine):
    requests = [(_prompt(3 + 7 * i, seed=i), SamplingParams(temperature=0.0, max_tokens=3 + i))
                for i in range(8)]
    expected = [engine.generate_sync(p, s).tokens for p, s in requests]
    results = _gather(*(engine.generate(p, s) for p, s in requests))
    assert [r.tokens for r in results] == expected
    events = perf.current().events()
    assert sum(e.value for e in events if e.name == perf.ENGINE_TOKENS) >= sum(map(len, expected))
    assert any(e.name == perf.ROLLOUT_DECODE for e in events)
    assert any(e.name == perf.ENGINE_BUSY for e in events)


def test_cancelling_a_task_frees_its_slot(engine):
    async def main():
        long = SamplingParams(temperature=0.0)  # runs until the cache is full
        tasks = [asyncio.create_task(engine.generate(_prompt(4, seed=i), long))
                 for i in range(SLOTS)]
        while engine.stats().active_slots < SLOTS:
            await asyncio.sleep(0.001)
        completed = engine.stats().completed
        short = asyncio.create_task(engine.generate(_prompt(5), GREEDY))
        tasks[0].cancel()
        result = await short
        # The waiting request got the cancelled request's slot while the others still decode.
        still_running = [not t.done() for t in tasks[1:]]
        for t in tasks[1:]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return result, still_running, completed
    result, still_running, completed = asyncio.run(main())
    assert len(result.tokens) == 6 and all(still_running)
    stats = engine.stats()
    assert stats.completed == completed + 1  # the cancelled ones never completed
    for _ in range(1000):
        if engine.stats().active_slots == 0:
            break
        threading.Event().wait(0.002)
    assert engine.stats().active_slots == 0


def test_stop_token_ids_and_stop_strings(engine):
    prompt = _prompt(9, seed=3)
    free = engine.generate_sync(prompt, SamplingParams(temperature=0.0, max_tokens=12)).tokens
    stop_id = free[4]
    first = free.index(stop_id)
    c = engine.generate_sync(prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                    stop_token_ids=(stop_id,)))
    assert c.tokens == free[:first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_id
    tok = LetterTokenizer()
    stop = tok.decode(free[5:7])
    k = next(k for k in range(1, 13) if stop in tok.decode(free[:k]))
    c = engine.generate_sync(prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                    stop=(stop,)))
    assert c.tokens == free[:k] and c.finish_reason == "stop" and c.stop_reason == stop


def test_stop_strings_without_tokenizer_are_a_request_error(model):
    engine = Engine(model, EngineConfig(max_slots=1, max_len=16))  # never started: validation comes first
    with pytest.raises(RequestError, match="needs a tokenizer"):
        engine.generate_sync([5, 6], SamplingParams(stop=("x",)))
    assert not engine.running


def test_max_tokens_and_the_cache_limit(engine):
    near_full = _prompt(MAX_LEN - 5, seed=4)
    c = engine.generate_sync(near_full, SamplingParams(temperature=0.0, max_tokens=100))
    assert len(c.tokens) == 5 and c.finish_reason == "cache_full"
    c = engine.generate_sync(near_full, SamplingParams(temperature=0.0, max_tokens=5))
    assert len(c.tokens) == 5 and c.finish_reason == "length"  # max_tokens wins a tie
    c = engine.generate_sync(_prompt(MAX_LEN - 1), SamplingParams(temperature=0.0))
    assert len(c.tokens) == 1 and c.finish_reason == "cache_full"
    with pytest.raises(RequestError, match="at most 63"):
        engine.generate_sync(_prompt(MAX_LEN), GREEDY)


def test_bad_requests_fail_alone_while_good_ones_carry_on(engine):
    good = [(_prompt(6 + i, seed=40 + i), GREEDY) for i in range(4)]
    expected = [engine.generate_sync(p, s).tokens for p, s in good]
    bad = [([], GREEDY), (_prompt(MAX_LEN + 3), GREEDY), ([5, 257], GREEDY), ([5, -1], GREEDY),
           ([1.5, 2.0], GREEDY), ([[1, 2]], GREEDY), ("hello", GREEDY), ([5], "greedy"),
           ([5], SamplingParams(stop_token_ids=(300,)))]
    mixed = [x for pair in zip(good, bad, strict=False) for x in pair] + bad[len(good):]
    results = _gather(*(engine.generate(p, s) for p, s in mixed))
    got_good = [r.tokens for r in results if not isinstance(r, BaseException)]
    errors = [r for r in results if isinstance(r, BaseException)]
    assert got_good == expected
    assert len(errors) == len(bad) and all(isinstance(e, RequestError) for e in errors)
    assert engine.running
    assert engine.generate_sync(*good[0]).tokens == expected[0]


def test_group_samples_differ_and_seeded_requests_reproduce(engine):
    prompt = _prompt(7, seed=8)
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=s) for s in range(4)]
    group = _gather(*(engine.generate(prompt, p) for p in params))
    assert len({g.tokens for g in group}) > 1
    # Seed 2 alone, then batched with other (unseeded, top-k/top-p) requests: same tokens.
    alone = engine.generate_sync(prompt, params[2])
    others = [engine.generate(_prompt(5 + i, seed=i), SamplingParams(top_k=5, top_p=0.8,
                                                                        max_tokens=10))
              for i in range(4)]
    batched = _gather(engine.generate(prompt, params[2]), *others)[0]
    assert alone.tokens == batched.tokens == group[2].tokens
    np.testing.assert_allclose(alone.logprobs, batched.logprobs, atol=1e-6)
    unseeded = _gather(*(engine.generate(prompt, SamplingParams(max_tokens=8)) for _ in range(2)))
    assert unseeded[0].tokens != unseeded[1].tokens


def test_session_prefills_only_new_tokens_with_and_without_eviction(engine):
    params = SamplingParams(temperature=0.0, max_tokens=5)
    prompt = _prompt(11, seed=9)
    with engine.session() as session:
        first = engine.generate_sync(prompt, params, session=session)
        assert first.num_prefilled == len(prompt) and first.num_cached == 0
        context = prompt + list(first.tokens) + [7, 8, 9, 10]  # a tool result
        second = engine.generate_sync(context, params, session=session)
        fresh = engine.generate_sync(context, params)
        assert second.tokens == fresh.tokens
        np.testing.assert_allclose(second.logprobs, fresh.logprobs, atol=1e-4)
        # Only the appended tokens, plus the last sampled one (its keys were never computed).
        assert second.num_prefilled == 4 + 1
        assert second.num_cached == len(context) - 5
        # Fill every slot with other sessions, then a plain request evicts the idle session.
        evictions = engine.stats().evictions
        others = [engine.session() for _ in range(SLOTS)]
        for i, other in enumerate(others):
            engine.generate_sync(_prompt(3, seed=i), params, session=other)
        assert engine.stats().evictions > evictions
        swapped_in = engine.stats().swapped_in
        third_context = context + list(second.tokens) + [11, 12]
        third = engine.generate_sync(third_context, params, session=session)
        # Its cache went to the host and came back: again only the new tokens are prefilled.
        assert engine.stats().swapped_in == swapped_in + 1
        assert third.num_prefilled == 2 + 1 and third.num_cached == len(third_context) - 3
        assert third.tokens == engine.generate_sync(third_context, params).tokens
        for other in others:
            other.close()


def test_session_misuse_is_a_request_error(engine):
    session = engine.session()

    async def two_at_once():
        return await asyncio.gather(engine.generate(_prompt(4), GREEDY, session=session),
                                    engine.generate(_prompt(4), GREEDY, session=session),
                                    return_exceptions=True)
    first, second = asyncio.run(two_at_once())
    assert len(first.tokens) == 6
    assert isinstance(second, RequestError) and "in flight" in str(second)
    session.close()
    with pytest.raises(RequestError, match="closed"):
        engine.generate_sync(_prompt(4), GREEDY, session=session)


def test_no_compilation_after_warmup(model):
    # A fresh engine: the very first steps after warm-up are the ones most likely to compile.
    engine = Engine(model, EngineConfig(max_slots=2, max_len=MAX_LEN, prefill_chunks=(8, 32), decode_buckets=4)).start()
    compiles = record_compiles()
    traces = engine.stats().traces
    # Decode is compiled once per attention bucket (quarters of the cache) at warm-up; the
    # workload below runs through all of them.
    assert sorted(k for k in traces if k.startswith("decode")) == [
        "decode_16", "decode_32", "decode_48", "decode_64"]
    workload = [(_prompt(n, seed=n), SamplingParams(temperature=t, top_k=k, top_p=p,
                                                     max_tokens=m))
                for n, t, k, p, m in [(1, 0.0, 0, 1.0, 3), (8, 1.0, 0, 1.0, 9), (9, 0.7, 5, 1.0, 2),
                                      (33, 1.0, 0, 0.9, 5), (50, 1.3, 3, 0.5, 20),
                                      (31, 0.0, 0, 1.0, 1), (62, 1.0, 0, 1.0, 4)]]
    results = _gather(*(engine.generate(p, s) for p, s in workload))
    with engine.session() as s:
        c = engine.generate_sync(_prompt(20), GREEDY, session=s)
        engine.generate_sync(_prompt(20) + list(c.tokens) + [3], GREEDY, session=s)
    engine.update_weights(nnx.state(model), version=1)
    assert engine.generate_sync(_prompt(3), GREEDY).policy_versions == (1,) * 6
    engine.stop()
    assert all(not isinstance(r, BaseException) for r in results)
    assert engine.stats().traces == traces
    assert compiles == []


def test_stop_aborts_running_requests_and_refuses_new_ones(model):
    engine = Engine(model, EngineConfig(max_slots=2, max_len=MAX_LEN, prefill_chunks=(8, 32))).start()
    future = engine.submit(_prompt(4), SamplingParams(temperature=0.0))
    while engine.stats().generated_tokens < 2:
        threading.Event().wait(0.001)
    engine.stop()
    c = future.result(timeout=10)
    assert c.finish_reason in ("aborted", "cache_full")
    assert len(c.tokens) == len(c.logprobs) == len(c.policy_versions) >= 2
    with pytest.raises(EngineError):
        engine.generate_sync(_prompt(4), GREEDY)


def test_jnp_is_not_needed_by_callers(engine):
    # Prompts may be numpy or jax arrays of ints, as well as lists.
    p = _prompt(6, seed=12)
    a = engine.generate_sync(np.asarray(p, np.int64), GREEDY).tokens
    b = engine.generate_sync(jnp.asarray(p, jnp.int32), GREEDY).tokens
    assert a == b == engine.generate_sync(p, GREEDY).tokens


def test_admission_with_every_slot_taken_still_seats_a_sessions_own_slot(model):
    """The scheduler's admission pass, driven by hand (its thread never started): once a plain
    request finds no free or evictable slot, later plain requests are not scanned, but a
    session whose turn is waiting still gets the slot it holds, ahead of the queue."""
    from nonstop.engine.config import EngineConfig
    from nonstop.engine.device import DeviceSteps
    from nonstop.engine.requests import Request
    from nonstop.engine.scheduler import Scheduler

    device = DeviceSteps(model, num_slots=SLOTS, max_len=MAX_LEN)
    sched = Scheduler(device, device.initial_state, 0,
                      EngineConfig(max_slots=SLOTS, max_len=MAX_LEN, prefill_chunks=(8,)), None)

    def request(seed, session=None):
        return Request(prompt=_prompt(4, seed=seed), temperature=0.0, top_k=0, top_p=1.0,
                       seed=0, max_tokens=2, stop_ids=frozenset(), stop=(), session=session,
                       resolve=lambda _: None)

    session = Session(sched, 0)
    sched._accept(request(0, session))
    sched._admit()
    own = session.slot
    assert own is not None
    sched._release(sched.slot_req[own])  # its turn ends: the slot stays the session's, idle
    assert sched.slot_owner[own] is session and sched.slot_req[own] is None
    busy = [request(1), request(2)]  # take the other slots
    for req in busy:
        sched._accept(req)
    sched._admit()
    assert sorted(r.slot for r in busy) == sorted(set(range(SLOTS)) - {own})
    queued = [request(3), request(4)]  # no free slot, and the session's is not evictable...
    turn = request(5, session)  # ...because its next turn is waiting behind them
    for req in (*queued, turn):
        sched._accept(req)
    sched._admit()
    assert turn.slot == own and sched.slot_req[own] is turn
    assert all(r.slot == -1 for r in queued) and list(sched.waiting) == queued
    assert sched.counters.evictions == 0
    # A slot frees up: the first queued request takes it, the next keeps waiting.
    freed = busy[0].slot
    sched._release(busy[0])
    sched._admit()
    assert queued[0].slot == freed and list(sched.waiting) == [queued[1]]
    # The admission pass stops at the first request it cannot seat: one slot search however
    # long the queue.
    searches = []
    free_slot = sched._free_slot
    sched._free_slot = lambda: searches.append(1) or free_slot()
    more = [request(10 + i) for i in range(50)]
    for req in more:
        sched._accept(req)
    sched._admit()
    assert searches == [1] and list(sched.waiting) == [queued[1], *more]


def test_new_weights_that_drop_session_caches_requeue_their_turns_in_arrival_order(model):
    """A turn returning to its session's slot queues like any request once new weights
    (on_weight_update="abort") dropped that slot's cache, in arrival order with the requests
    already waiting."""
    from nonstop.engine.config import EngineConfig
    from nonstop.engine.device import DeviceSteps
    from nonstop.engine.requests import Request
    from nonstop.engine.scheduler import Scheduler

    device = DeviceSteps(model, num_slots=SLOTS, max_len=MAX_LEN)
    sched = Scheduler(device, device.initial_state, 0, EngineConfig(
        max_slots=SLOTS, max_len=MAX_LEN, prefill_chunks=(8,), on_weight_update="abort"),
        None)

    def request(seed, session=None):
        return Request(prompt=_prompt(4, seed=seed), temperature=0.0, top_k=0, top_p=1.0,
                       seed=0, max_tokens=2, stop_ids=frozenset(), stop=(), session=session,
                       resolve=lambda _: None)

    sessions = [Session(sched, i) for i in range(SLOTS)]
    for i, session in enumerate(sessions):
        sched._accept(request(i, session))
    sched._admit()
    for req in list(sched.slot_req):
        sched._release(req)  # every slot now holds an idle session's cache
    early = request(100)
    sched._accept(early)  # waits: nothing is free, but it is older than the turns below
    late_turns = [request(200 + i, s) for i, s in enumerate(sessions[:2])]
    for req in late_turns:
        sched._accept(req)
    assert list(sched.returning) == late_turns and list(sched.waiting) == [early]
    sched._apply_weights(device.initial_state, 1)
    assert not sched.returning and list(sched.waiting) == [early, *late_turns]
    assert all(s.slot is None for s in sessions)
    sched._admit()  # every slot is free now: all three are seated, the oldest first
    assert [r.slot for r in (early, *late_turns)] == [0, 1, 2] and not sched.waiting


def _two_turns(engine, *, evict):
    """A session's two turns, with every slot taken by other sessions in between if `evict`."""
    params = SamplingParams(temperature=0.0, max_tokens=5)
    prompt = _prompt(11, seed=9)
    with engine.session() as session:
        first = engine.generate_sync(prompt, params, session=session)
        others = [engine.session() for _ in range(SLOTS if evict else 0)]
        for i, other in enumerate(others):
            engine.generate_sync(_prompt(3, seed=i), params, session=other)
        second = engine.generate_sync(prompt + list(first.tokens) + [7, 8, 9], params,
                                      session=session)
        for other in others:
            other.close()
    return second


def test_a_swapped_session_cache_is_bit_exact_and_without_swap_it_is_recomputed(engine, model):
    kept = _two_turns(engine, evict=False)
    before = engine.stats()
    swapped = _two_turns(engine, evict=True)
    after = engine.stats()
    assert after.evictions > before.evictions and after.swapped_in == before.swapped_in + 1
    # The restored keys and values are the ones computed before: identical results.
    assert swapped.num_cached == kept.num_cached == 11 + 4
    assert swapped.tokens == kept.tokens and swapped.logprobs == kept.logprobs
    with Engine(model, EngineConfig(max_slots=SLOTS, max_len=MAX_LEN, prefill_chunks=(8, 32))) as off:
        recomputed = _two_turns(off, evict=True)
        assert off.stats().evictions >= 1 and off.stats().swapped_out == 0
        assert "read_slot" not in off.stats().traces  # nothing compiled for it
    assert recomputed.num_cached == 0 and recomputed.num_prefilled == 11 + 5 + 3
    assert recomputed.tokens == kept.tokens
    np.testing.assert_allclose(recomputed.logprobs, kept.logprobs, atol=1e-4)


def test_swap_round_trip_and_budget(model):
    """The device's slot read and write, and the host budget, driven by hand."""
    from nonstop.engine.config import EngineConfig
    from nonstop.engine.device import DeviceSteps
    from nonstop.engine.scheduler import Scheduler

    device = DeviceSteps(model, num_slots=SLOTS, max_len=MAX_LEN)
    cfg = model.cfg
    per = device.slot_position_bytes()
    assert per == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    rng = np.random.default_rng(0)
    kv = rng.normal(size=(2, cfg.num_layers, cfg.num_kv_heads, 6, cfg.head_dim)
                    ).astype(np.float32)  # keys, then values
    cache = device.write_slot(device.new_cache(), 1, kv)
    np.testing.assert_array_equal(device.read_slot(cache, 1, 6), kv)
    for layer in range(cfg.num_layers):
        np.testing.assert_array_equal(np.asarray(cache.keys[layer][1, :, :6]), kv[0, layer])
        np.testing.assert_array_equal(np.asarray(cache.values[layer][1, :, :6]), kv[1, layer])
    assert not np.asarray(cache.keys[0][0]).any()  # other slots untouched
    assert not np.asarray(cache.keys[0][1, :, 6:]).any()  # the rest of the row zeroed

    sched = Scheduler(device, device.initial_state, 0, EngineConfig(
        max_slots=SLOTS, max_len=MAX_LEN, prefill_chunks=(8,),
        swap_space_gib=10.5 * per / 2**30), None)
    sched.cache = cache
    a, b, c = (Session(sched, i) for i in range(3))
    sched.slot_tokens[0], sched.slot_tokens[1], sched.slot_tokens[2] = [5] * 4, [6] * 6, [7] * 11
    assert sched._evict(a, 0) and sched.evicted.swap.bytes == 4 * per
    assert sched._evict(b, 1) and sched.evicted.swap.bytes == 10 * per
    # The copies were launched, not waited for: device rows until settled, which takes them
    # to the host as just the sessions' positions.
    assert not b.swapped.on_host and list(sched.evicted.swap.copying) == [a, b]
    assert b.swapped.kv.shape == (2, cfg.num_layers, cfg.num_kv_heads, MAX_LEN, cfg.head_dim)
    from_device = device.write_slot(device.new_cache(), 2, b.swapped.kv)
    np.testing.assert_array_equal(np.asarray(from_device.values[1][2]),
                                  np.asarray(cache.values[1][1]))  # written back as it is
    sched.evicted.swap.settle(wait=True)
    assert b.swapped.on_host and not sched.evicted.swap.copying and sched.evicted.swap.bytes == 10 * per
    np.testing.assert_array_equal(b.swapped.kv, kv)
    assert b.swapped.kv.nbytes == 6 * per
    assert sched._evict(c, 2)  # 11 positions never fit: not copied, nothing dropped
    assert c.swapped is None and sched.counters.swap_dropped == 0
    sched.slot_tokens[2] = [7] * 3
    assert sched._evict(c, 2)  # 13 > 10: the least recently evicted (a) is dropped
    assert a.swapped is None and b.swapped.tokens == (6,) * 6 and c.swapped.tokens == (7,) * 3
    assert sched.counters.swap_dropped == 1 and sched.evicted.swap.bytes == 9 * per
    assert list(sched.evicted.swap.sessions) == [b, c]
    sched._close_session(b)  # a closed session's host copy goes too
    assert b.swapped is None and sched.evicted.swap.bytes == 3 * per


def test_park_moves_rows_out_and_back_in_one_call(model):
    """`DeviceSteps.park`: a slot gives its row to the parking cache and takes a parked one back
    in the same call; rows named in no move are left alone; any move count up to the slot
    count runs in the one compilation; more is refused before anything moves."""
    from nonstop.engine.device import DeviceSteps

    device = DeviceSteps(model, num_slots=SLOTS, max_len=MAX_LEN, parked_slots=4)
    cfg = model.cfg
    rng = np.random.default_rng(1)
    shape = (2, cfg.num_layers, cfg.num_kv_heads, MAX_LEN, cfg.head_dim)
    x, y = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
    cache = device.write_slot(device.new_cache(), 1, x)
    pool = device.write_slot(device.new_pool(), 2, y)
    cache, pool = device.park(cache, pool, [(1, 0)], [(2, 1)])
    np.testing.assert_array_equal(device.read_slot(pool, 0, MAX_LEN), x)
    np.testing.assert_array_equal(device.read_slot(cache, 1, MAX_LEN), y)
    np.testing.assert_array_equal(device.read_slot(pool, 2, MAX_LEN), y)  # a copy: kept
    for s in (0, 2):
        assert not device.read_slot(cache, s, MAX_LEN).any()
    assert not device.read_slot(pool, 1, MAX_LEN).any() and not device.read_slot(
        pool, 3, MAX_LEN).any()
    cache, pool = device.park(cache, pool, [(1, 3), (0, 1)], [(0, 2)])  # 2 out, 1 back
    np.testing.assert_array_equal(device.read_slot(pool, 3, MAX_LEN), y)
    np.testing.assert_array_equal(device.read_slot(cache, 2, MAX_LEN), x)
    assert not device.read_slot(pool, 1, MAX_LEN).any()  # slot 0 was empty
    cache, pool = device.park(cache, pool, [], [(3, s) for s in range(SLOTS)])  # all back
    for s in range(SLOTS):
        np.testing.assert_array_equal(device.read_slot(cache, s, MAX_LEN), y)
    with pytest.raises(ValueError, match="at most num_slots"):
        device.park(cache, pool, [(0, 0)] * (SLOTS + 1), [])
    assert device.traces["park"] == 1


def test_parking_rows_moved_back_are_reused_only_after_their_call():
    from nonstop.engine.requests import Counters
    from nonstop.engine.swap import Parking

    counters = Counters()
    parking = Parking(2, counters)
    a, b, c = (Session(None, i) for i in range(3))  # type: ignore[arg-type]
    parking.park(a, 0, [1, 2])
    parking.park(b, 1, [3])
    assert parking.take_moves() == ([(0, 0), (1, 1)], []) and parking.full()
    assert parking.unpark(a, 2) == [1, 2] and parking.pending
    # Its row is read by this pass's call: filling it in the same call is not allowed.
    assert parking.full() and parking.oldest() == (b, 1)
    assert parking.take_moves() == ([], [(0, 2)]) and not parking.full()
    parking.park(c, 2, [4])
    assert parking.sessions == {b: 1, c: 0} and parking.tokens[0] == [4]
    parking.drop(b)
    assert not parking.full() and parking.tokens[1] == [] and list(parking.sessions) == [c]
    assert (counters.parked, counters.unparked) == (3, 1)


def test_a_parked_session_cache_is_bit_exact_and_a_full_parking_cache_overflows_to_the_host(
        model):
    """`parked_slots`: an evicted session's cache is moved to the parking cache and back into
    the slot its next turn gets, so that turn prefills only its new tokens and gives exactly the
    tokens and logprobs it would have without the eviction. With the parking cache full, the
    least recently parked goes on to the host swap and comes back from there."""
    with Engine(model, EngineConfig(max_slots=SLOTS, max_len=MAX_LEN, prefill_chunks=(8, 32), parked_slots=4)) as engine:
        traces = engine.stats().traces
        assert traces["park"] == 1  # compiled at warm-up
        kept = _two_turns(engine, evict=False)
        before = engine.stats()
        parked = _two_turns(engine, evict=True)
        after = engine.stats()
        assert after.evictions > before.evictions and after.parked > before.parked
        assert after.unparked == before.unparked + 1 and after.park_dropped == 0
        assert after.swapped_out == 0 and engine.stats().traces == traces  # nothing compiled
    assert parked.num_cached == kept.num_cached == 11 + 4
    assert parked.tokens == kept.tokens and parked.logprobs == kept.logprobs
    with Engine(model, EngineConfig(max_slots=SLOTS, max_len=MAX_LEN, prefill_chunks=(8, 32), parked_slots=1, swap_space_gib=0.01)) as engine:
        traces = engine.stats().traces
        overflowed = _two_turns(engine, evict=True)
        stats = engine.stats()
        assert stats.park_dropped >= 1 and stats.swapped_out >= 1 and stats.swapped_in == 1
        assert engine.stats().traces == traces
    assert overflowed.num_cached == 11 + 4
    assert overflowed.tokens == kept.tokens and overflowed.logprobs == kept.logprobs
