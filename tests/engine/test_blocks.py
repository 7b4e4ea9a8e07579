"""The paged KV cache's block pool: reference counts, the prefix cache, and its invariants
under long random runs of what the scheduler does to it."""

from __future__ import annotations

import random

import pytest

from nonstop.engine.blocks import ROOT_HASH, BlockPool, blocks_for

BS = 4


def _keys(tokens, version):
    """The chained keys of `tokens`' full blocks."""
    out, parent = [], ROOT_HASH
    for i in range(len(tokens) // BS):
        hashed = BlockPool.key(parent, version, tokens[i * BS:(i + 1) * BS])
        out.append(hashed)
        parent = hashed[0]
    return out


def test_allocate_share_release_and_cache_states():
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 2
    assert pool.allocate(3) is None and pool.num_free == 2  # all or nothing
    pool.share(a[0])
    pool.release(a)
    assert pool.refs[a[0]] == 1 and pool.num_free == 4
    keyed = _keys([1, 2, 3, 4], version=0)[0]
    assert pool.register(a[0], keyed)
    pool.release([a[0]])  # keyed: cached, not free; still found
    assert pool.lookup(keyed) == a[0] and pool.num_free == 5
    pool.share(a[0])  # a hit takes it back out of the cache
    assert pool.num_free == 4
    pool.release([a[0]])
    # Free blocks are handed out before cached ones; the cached one goes last, losing its key.
    got = pool.allocate(5)
    assert got[-1] == a[0] and pool.lookup(keyed) is None and pool.evicted == 1
    pool.release(got)
    pool.check()
    assert pool.num_free == 5
    with pytest.raises(ValueError, match="not held"):
        pool.release([0])
    with pytest.raises(ValueError, match="is free"):
        pool.share(0)


def test_keys_chain_over_the_prefix_and_include_the_version():
    a = _keys([1, 2, 3, 4, 5, 6, 7, 8], version=0)
    b = _keys([9, 2, 3, 4, 5, 6, 7, 8], version=0)  # first block differs: so does the second key
    c = _keys([1, 2, 3, 4, 5, 6, 7, 8], version=1)
    assert a[1][1] != b[1][1] and a[0][1] != c[0][1] and a[1][1] != c[1][1]
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    for block, hashed in zip(blocks, a, strict=True):
        assert pool.register(block, hashed)
    assert [pool.lookup(h) for h in a] == blocks
    assert [pool.lookup(h) for h in c] == [None, None]
    assert not pool.register(pool.allocate(1)[0], a[0])  # a key names one block
    pool.clear_keys()
    assert pool.lookup(a[0]) is None


def test_invariants_under_ten_thousand_random_operations():
    """Submits (with prefix-cache hits), n-sample forks, decode growth with preemption of the
    youngest sequence when no block is left, cancels, session turns and ends, and weight
    updates; the pool's reference counts always equal the references the sequences hold, and
    at the end every block is back."""
    rng = random.Random(0)
    pool = BlockPool(64)
    version = 0
    seqs: dict[int, list[int]] = {}  # id -> block table (a session's too, between turns)
    tokens: dict[int, list[int]] = {}
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    next_id = 0
    preempted = 0

    def free(sid):
        pool.release(seqs.pop(sid))
        del tokens[sid]

    def submit(prompt):
        nonlocal next_id
        table = []
        for hashed in _keys(prompt[:-1], version):  # the last token is always computed
            block = pool.lookup(hashed)
            if block is None:
                break
            pool.share(block)
            table.append(block)
        new = pool.allocate(blocks_for(len(prompt), BS) - len(table))
        if new is None:
            pool.release(table)
            return None
        for hashed, block in zip(_keys(prompt, version)[len(table):], new, strict=False):
            pool.register(block, hashed)
        seqs[next_id], tokens[next_id] = table + new, list(prompt)
        next_id += 1
        return next_id - 1

    for _ in range(10_000):
        op = rng.random()
        if op < 0.3:
            submit(rng.choice(prompts) + [rng.randrange(5) for _ in range(rng.randrange(3))])
        elif op < 0.4 and seqs:  # n samples of one prompt: share every full block
            sid = rng.choice(list(seqs))
            full = len(tokens[sid]) // BS
            for _ in range(rng.randrange(1, 4)):
                new = pool.allocate(1)
                if new is None:
                    break
                for block in seqs[sid][:full]:
                    pool.share(block)
                seqs[next_id] = seqs[sid][:full] + new
                tokens[next_id] = tokens[sid][:full * BS]
                next_id += 1
        elif op < 0.75 and seqs:  # decode a token; a new block may be needed
            sid = rng.choice(list(seqs))
            if len(tokens[sid]) == len(seqs[sid]) * BS:
                while (new := pool.allocate(1)) is None:
                    youngest = max(seqs)
                    free(youngest)  # preempted: recomputed later
                    preempted += 1
                    if youngest == sid:
                        break
                if sid not in seqs:
                    continue
                seqs[sid] += new
            tokens[sid].append(rng.randrange(5))
        elif op < 0.95 and seqs:  # finish, cancel or close a session
            free(rng.choice(list(seqs)))
        else:  # a weight update: nothing computed before it may be hit again
            version += 1
            pool.clear_keys()
        if rng.random() < 0.05:
            pool.check()
            expected = [0] * pool.num_blocks
            for table in seqs.values():
                for block in table:
                    expected[block] += 1
            assert pool.refs == expected
    assert preempted > 0 and pool.hits > 0 and pool.evicted > 0  # every path ran
    for sid in list(seqs):
        free(sid)
    pool.check()
    assert pool.num_free == pool.num_blocks and not any(pool.refs)
