"""The paged KV cache in the engine: a pool far smaller than the requests in flight need
(preemption and resume by recompute), shared prompt blocks and the prefix cache (keyed by the
policy version), sessions keeping blocks, and the seam for platform attention kernels. Each
result is compared with the tokens of an unconstrained, unshared run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nonstop.engine import Engine, EngineConfig, SamplingParams
from nonstop.engine.config import kv_cache_tokens_for
from nonstop.models import ModelConfig, paged
from tests.engine.engine_fixtures import random_prompt, sharp_tiny_model

MAX_LEN = 64
BS = 4


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model(seed=7)


def _config(**overrides):
    base = dict(max_slots=6, max_len=MAX_LEN, prefill_chunks=(8, 32), kv_layout="paged",
                block_size=BS)
    return EngineConfig(**{**base, **overrides})


def _run(engine, requests, timeout=300):
    futures = [engine.submit(p, s) for p, s in requests]
    return [f.result(timeout=timeout) for f in futures]


@pytest.fixture(scope="module")
def mixed_requests():
    rng = np.random.RandomState(3)
    return [(random_prompt(int(rng.randint(1, 40)), seed=100 + i),
             SamplingParams(temperature=0.0, max_tokens=int(rng.randint(1, 24))))
            for i in range(32)]


@pytest.fixture(scope="module")
def unconstrained(model, mixed_requests):
    """The mixed requests on a dense engine, one at a time."""
    with Engine(model, EngineConfig(max_slots=2, max_len=MAX_LEN, prefill_chunks=(8, 32))) as e:
        return [e.generate_sync(p, s).tokens for p, s in mixed_requests]


def test_a_tiny_pool_completes_32_concurrent_requests_with_unconstrained_tokens(
        model, mixed_requests, unconstrained):
    # Two sequences' worth of positions for six slots and 32 requests: running sequences
    # run out of blocks, are preempted and resume by recomputing their context.
    config = _config(kv_cache_tokens=2 * MAX_LEN, prefix_cache=False)
    with Engine(model, config) as engine:
        warm = dict(engine.stats().traces)
        results = _run(engine, mixed_requests)
        stats = engine.stats()
        assert [r.tokens for r in results] == unconstrained
        assert all(r.finish_reason == "length" for r in results)
        assert stats.preemptions > 0 and stats.completed == 32
        assert stats.free_blocks == config.num_blocks  # every block back in the pool
        assert stats.traces == warm  # nothing compiled after warm-up


def test_prefix_cache_hits_give_the_tokens_of_an_unshared_run(model):
    system = random_prompt(30, seed=1)
    requests = [(system + random_prompt(3 + i, seed=50 + i),
                 SamplingParams(temperature=0.0, max_tokens=8)) for i in range(4)]
    with Engine(model, _config(prefix_cache=False)) as engine:
        unshared = [engine.generate_sync(p, s) for p, s in requests]
        assert all(r.num_cached == 0 for r in unshared)
    with Engine(model, _config()) as engine:
        shared = [engine.generate_sync(p, s) for p, s in requests]
        # The first computes the prompt; the others find its 7 full blocks (28 positions).
        assert [r.num_cached for r in shared] == [0, 28, 28, 28]
        # A whole earlier request (prompt and completion) is a prefix of a session-less
        # next turn: its full blocks are found too.
        p, s = requests[0]
        follow = p + list(shared[0].tokens) + [5, 6, 7]
        again = engine.generate_sync(follow, s)
        assert again.num_cached == (len(p) + len(shared[0].tokens) - 1) // BS * BS
    assert [r.tokens for r in shared] == [r.tokens for r in unshared]
    for a, b in zip(shared, unshared, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    with Engine(model, EngineConfig(max_slots=2, max_len=MAX_LEN,
                                    prefill_chunks=(8, 32))) as dense:
        assert dense.generate_sync(follow, s).tokens == again.tokens


def test_n_samples_of_one_prompt_prefill_it_once(model):
    prompt = random_prompt(41, seed=9)
    samples = [(prompt, SamplingParams(temperature=1.0, max_tokens=6, seed=i)) for i in range(8)]
    with Engine(model, _config(prefix_cache=False)) as engine:
        unshared = _run(engine, samples)
        assert engine.stats().prefilled_tokens == 8 * 41
    with Engine(model, _config(max_slots=8)) as engine:
        shared = _run(engine, samples)
        stats = engine.stats()
    # The prompt's 10 full blocks are computed once; each sample recomputes the last token.
    assert stats.prefilled_tokens == 41 + 7 * 1
    assert [r.tokens for r in shared] == [r.tokens for r in unshared]
    assert len({tuple(r.tokens) for r in shared}) > 1  # they are different samples


def test_a_weight_update_never_yields_a_cross_version_hit(model):
    prompt = random_prompt(33, seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    other = sharp_tiny_model(seed=8)
    with Engine(other, _config()) as fresh:
        expected_v1 = fresh.generate_sync(prompt, greedy).tokens
    with Engine(model, _config()) as engine:
        v0 = engine.generate_sync(prompt, greedy)
        assert engine.generate_sync(prompt, greedy).num_cached == 32  # a hit, same version
        engine.update_weights(nnx.state(other), version=1)
        v1 = engine.generate_sync(prompt, greedy)
        assert v1.num_cached == 0 and v1.policy_versions == (1,) * 6
        assert v1.tokens == expected_v1 and v1.tokens != v0.tokens
        assert engine.generate_sync(prompt, greedy).num_cached == 32  # hits at version 1


def test_sessions_keep_their_blocks_and_give_them_up_under_pressure(model):
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    contexts = [random_prompt(9 + i, seed=60 + i) for i in range(6)]
    with Engine(model, EngineConfig(max_slots=2, max_len=MAX_LEN,
                                    prefill_chunks=(8, 32))) as dense:
        turn1 = [dense.generate_sync(c, greedy).tokens for c in contexts]
        turn2 = [dense.generate_sync(c + list(t) + [3, 4], greedy).tokens
                 for c, t in zip(contexts, turn1, strict=True)]
    # With room, every session keeps its blocks between turns: only the two new tokens and
    # the last one generated (never fed) are computed. With room for about two sessions'
    # contexts, the least recently used idle ones are freed and their turns recompute.
    for tokens, kept in ((8 * MAX_LEN, True), (MAX_LEN + 16, False)):
        config = _config(max_slots=2, kv_cache_tokens=tokens, prefix_cache=False)
        with Engine(model, config) as engine:
            sessions = [engine.session() for _ in contexts]
            first = [engine.generate_sync(c, greedy, session=s)
                     for c, s in zip(contexts, sessions, strict=True)]
            second = [engine.generate_sync(c + list(f.tokens) + [3, 4], greedy, session=s)
                      for c, f, s in zip(contexts, first, sessions, strict=True)]
            stats = engine.stats()
            for s in sessions:
                s.close()
            if kept:
                assert [r.num_cached for r in second] == [len(c) + 4 for c in contexts]
                assert stats.evictions == 0
            else:
                assert stats.evictions > 0 and second[0].num_cached == 0
            assert [f.tokens for f in first] == turn1 and [s.tokens for s in second] == turn2
            engine.generate_sync(contexts[0], greedy)  # closing went through before this
            assert engine.stats().free_blocks == config.num_blocks


def test_a_platform_kernel_plugs_in_and_matches_the_plain_path(model):
    """A kernel registered for this platform serves decode attention (here a reference
    implementation over the pool; on TPU it would be Pallas's paged attention)."""
    calls = []

    def reference_kernel(q, k_pool, v_pool, tables, lengths, scale):
        calls.append(q.shape)
        keys, values = paged.gather(k_pool, tables), paged.gather(v_pool, tables)
        B, N, H = q.shape
        K = keys.shape[1]
        qg = q.reshape(B, K, N // K, H)
        scores = jnp.einsum("bkgh,bklh->bkgl", qg, keys.astype(q.dtype)) * scale
        valid = jnp.arange(keys.shape[2])[None, :] < lengths[:, None]
        scores = jnp.where(valid[:, None, None, :], scores.astype(jnp.float32), -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        return jnp.einsum("bkgl,bklh->bkgh", probs, values.astype(q.dtype)).reshape(B, N, H)

    requests = [(random_prompt(5 + 7 * i, seed=i), SamplingParams(temperature=0.0, max_tokens=7))
                for i in range(3)]
    with Engine(model, _config()) as engine:
        plain = _run(engine, requests)
    paged.register_kernel(jax.default_backend(), reference_kernel)
    try:
        with Engine(model, _config()) as engine:
            kernel = _run(engine, requests)
    finally:
        paged._KERNELS.pop(jax.default_backend())
    assert calls  # traced into decode
    assert [r.tokens for r in kernel] == [r.tokens for r in plain]
    for a, b in zip(kernel, plain, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


def _gathered_attention(q, k_pool, v_pool, tables, lengths, scale):
    """Decode attention the plain way: the rows' blocks copied out whole, one softmax."""
    keys, values = paged.gather(k_pool, tables), paged.gather(v_pool, tables)
    B, N, H = q.shape
    K = keys.shape[1]
    qg = q.reshape(B, K, N // K, H)
    scores = jnp.einsum("bkgh,bklh->bkgl", qg, keys) * scale
    valid = jnp.arange(keys.shape[2])[None, :] < lengths[:, None]
    probs = jax.nn.softmax(jnp.where(valid[:, None, None, :], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bkgl,bklh->bkgh", probs, values).reshape(B, N, H)


def test_blockwise_decode_attention_matches_the_gathered_one_and_is_batch_invariant():
    """`attend_blocks` (the default decode path) against the whole-gather softmax on random
    pools, tables of 11 entries (not a multiple of the blocks it reads a step) and lengths
    from 1 to the table's end; a row's result is bit for bit the same whatever the others'
    lengths (fewer or more loop iterations)."""
    rng = np.random.default_rng(3)
    NB, K, bs, H, N, MB, B = 37, 2, 5, 7, 6, 11, 5
    k_pool, v_pool = (jnp.asarray(rng.normal(size=(NB, K, bs, H)), jnp.float32)
                      for _ in range(2))
    tables = jnp.asarray(rng.integers(0, NB, (B, MB)), jnp.int32)
    q = jnp.asarray(rng.normal(size=(B, N, H)), jnp.float32)
    lengths = jnp.asarray([1, 4, 23, 40, MB * bs], jnp.int32)
    got = jax.jit(paged.attend_blocks, static_argnums=5)(q, k_pool, v_pool, tables, lengths,
                                                           0.3)
    want = _gathered_attention(q, k_pool, v_pool, tables, lengths, 0.3)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # Row 1 alone with short neighbours (one loop iteration) and with a parked one (a length
    # past the table, not counted): the same bits as among long ones.
    for others in ([1, 4, 2, 3, 1], [1, 4, 2, 3, MB * bs + 1]):
        alone = paged.attend_blocks(q, k_pool, v_pool, tables, jnp.asarray(others, jnp.int32),
                                    0.3)
        np.testing.assert_array_equal(alone[1], got[1])


def test_kv_cache_tokens_from_a_memory_budget():
    cfg = ModelConfig.tiny("qwen3")
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert kv_cache_tokens_for(cfg, per_token * 100, block_size=16) == 96
    with pytest.raises(ValueError, match="hold no block"):
        kv_cache_tokens_for(cfg, per_token * 15, block_size=16)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        EngineConfig(max_len=64, kv_layout="paged", kv_cache_tokens=32)
    with pytest.raises(ValueError, match="parked_slots"):
        EngineConfig(kv_layout="paged", parked_slots=4)


def test_samples_sharing_blocks_a_cancelled_writer_never_computed_restart_and_match(model):
    """The scheduler driven by hand: three samples of one prompt are admitted together, the
    first computes the shared blocks and the others wait for it. Cancelled before it ran, its
    blocks lose their keys and the others go back to the queue, in order; one of them then
    computes the prompt, the other shares it, and both give an unshared run's tokens."""
    from nonstop.engine.device import DeviceSteps
    from nonstop.engine.requests import Request
    from nonstop.engine.scheduler import Scheduler

    config = _config(max_slots=4)
    device = DeviceSteps(model, num_slots=4, max_len=MAX_LEN, num_blocks=config.num_blocks,
                         block_size=BS)
    sched = Scheduler(device, device.initial_state, 0, config, None)
    prompt = random_prompt(21, seed=12)
    results = {}

    def request(i):
        return Request(prompt=prompt, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                       max_tokens=4, stop_ids=frozenset(), stop=(), session=None,
                       resolve=lambda r: results.__setitem__(i, r))

    writer, *followers = reqs = [request(i) for i in range(3)]
    for req in reqs:
        sched._accept(req)
    sched._admit()
    assert all(r.slot >= 0 for r in reqs) and len(sched.blocks.pending) == 5
    assert sched.blocks.ready(writer) and not any(sched.blocks.ready(f) for f in followers)
    assert sched._next_prefill_rows()[0][1] is writer  # the others cannot go first
    sched._cancel(writer)
    assert list(sched.waiting) == followers and not sched.blocks.pending
    assert sched.counters.preemptions == 2 and sched.blocks.pool.num_held == 0
    while len(results) < 2:
        sched._admit()
        if sched.prefilling:
            sched._prefill_some()
        sched._decode_step()
    with Engine(model, EngineConfig(max_slots=1, max_len=MAX_LEN,
                                    prefill_chunks=(8, 32))) as dense:
        expected = dense.generate_sync(prompt, SamplingParams(temperature=0.0, max_tokens=4))
    assert [results[i].tokens for i in (1, 2)] == [expected.tokens] * 2
    assert sorted(results[i].num_cached for i in (1, 2)) == [0, 20]
    sched.blocks.pool.check()
    assert sched.blocks.pool.num_free == config.num_blocks
