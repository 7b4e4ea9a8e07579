"""`EngineConfig`'s prefill plans and decode attention buckets, against hand-worked values."""

import itertools

import pytest

from nonstop.engine.config import CALL_COST_TOKENS, EngineConfig
from nonstop.models.validation import ConfigError


def _brute_force_cost(sizes, length):
    """Least (padded tokens + CALL_COST_TOKENS per call) over every chunk multiset covering
    `length`, by enumeration (independent of the dynamic programme)."""
    best = None
    limit = length // min(sizes) + 1
    for counts in itertools.product(*(range(limit + 1) for _ in sizes)):
        covered = sum(c * s for c, s in zip(counts, sizes, strict=True))
        calls = sum(counts)
        if calls == 0 or covered < length:
            continue
        # All but one chunk must be full: dropping any chunk must leave less than `length`.
        if any(c and covered - s >= length for c, s in zip(counts, sizes, strict=True)):
            continue
        cost = covered + CALL_COST_TOKENS * calls
        best = cost if best is None else min(best, cost)
    return best


def test_prefill_plan_pads_little_and_counts_calls():
    config = EngineConfig(max_len=512, prefill_chunks=(16, 64, 256))
    assert CALL_COST_TOKENS == 32
    # 140 tokens: one padded 256 costs 256 + 32 = 288; 64 + 64 + 16 costs 144 + 96 = 240.
    assert config.prefill_plan(140) == (64, 64, 16)
    # 200: 256 + 32 = 288 beats 64 x 4 = 256 + 128 = 384 and 64 x 3 + 16 = 208 + 128 = 336.
    assert config.prefill_plan(200) == (256,)
    assert config.prefill_plan(300) == (256, 64)
    assert config.prefill_plan(16) == (16,)
    assert config.prefill_plan(1) == (16,)
    # 17: 16 + 16 and 64 both cost 96; the tie goes to fewer calls.
    assert config.prefill_plan(17) == (64,)
    assert config.next_chunk(140) == (64, 64)
    assert config.next_chunk(12) == (12, 16)
    assert config.padded_size(17) == 64 and config.padded_size(300) == 256


@pytest.mark.parametrize("sizes", [(16, 64, 256), (8, 32), (3,), (5, 12, 40)])
def test_prefill_plan_is_the_cheapest_cover(sizes):
    config = EngineConfig(max_len=1024, prefill_chunks=sizes)
    for length in range(1, 121):
        plan = config.prefill_plan(length)
        assert sum(plan[:-1]) < length <= sum(plan)  # only the last chunk is padded
        assert sum(plan) + CALL_COST_TOKENS * len(plan) == _brute_force_cost(sizes, length)


def test_attention_lengths_are_rounded_quarters_of_the_cache():
    assert EngineConfig(max_len=512).attention_lengths == (512,)  # default: batch-invariant
    assert EngineConfig(max_len=512, decode_buckets=4).attention_lengths == (128, 256, 384, 512)
    config = EngineConfig(max_len=48, decode_buckets=4)
    assert config.attention_lengths == (16, 32, 48)  # 12 -> 16, 24 -> 32, 36 -> 48
    assert [config.attention_length(p) for p in (0, 15, 16, 31, 32, 47)] == [16, 16, 32, 32, 48,
                                                                             48]
    assert EngineConfig(max_len=512, decode_buckets=1).attention_lengths == (512,)
    assert EngineConfig(max_len=10, decode_buckets=8).attention_lengths == (10,)
    with pytest.raises(ConfigError, match="decode_buckets"):
        EngineConfig(decode_buckets=0)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "4"])
def test_swap_space_must_be_a_number_of_gib(bad):
    with pytest.raises(ConfigError, match="swap_space_gib"):
        EngineConfig(swap_space_gib=bad)
    assert EngineConfig().swap_space_gib == 0  # off by default
    assert EngineConfig(swap_space_gib=2).swap_space_gib == 2
