"""`EngineConfig`: the size of the KV cache, the prefill chunk buckets, and the scheduler policy."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Literal, get_args

from nonstop.models.config import ModelConfig
from nonstop.models.validation import check, check_choice, check_int, check_ints

WeightUpdateMode = Literal["continue", "abort"]
CacheDtype = Literal["float32", "bfloat16"]
KVLayout = Literal["dense", "paged"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine is sized and scheduled (docs/engine.md has what each setting is worth).

    max_slots: sequences decoded together (S); with the dense layout the KV cache is
        max_slots x max_len.
    max_len: positions per sequence; prompt + completion never exceed it ("cache_full").
    kv_layout: "dense": one max_len row of cache per slot. "paged": a pool of blocks of
        `block_size` positions holding `kv_cache_tokens` positions in all, each sequence taking
        blocks as it grows (`blocks.py`): how many sequences hold context at once is bounded by
        free blocks, not slots; idle sessions keep their blocks until the pool runs short, a
        running sequence that cannot get one is preempted and resumed later by recomputing
        its context, and full blocks are reused across requests through the prefix cache.
    block_size: positions per block (paged).
    kv_cache_tokens: positions the paged pool holds (rounded down to whole blocks); None: as
        many as the dense cache, max_slots x max_len. At least max_len. `kv_cache_tokens_for`
        turns a memory budget into it.
    prefix_cache: reuse the keys and values of full blocks whose whole prefix (tokens and
        policy version) matches an earlier or concurrent request's (paged).
    prefill_chunks: chunk lengths prefill is compiled for; a prompt runs as the chunks that cost
        least in padding plus per-call overhead (`prefill_plan`). Clipped to max_len.
    prefill_budget: prompt tokens prefilled between two decode steps while others decode: more
        gives a faster first token, slower decoding.
    prefill_rows: the most prompts (with next chunks of equal length) prefilled in one call.
        More cuts per-call cost when many turns start at once; above 1 a row's float summation
        depends on what else was waiting (logprobs move at the 1e-7 level).
    decode_buckets: decode is compiled for attention over the first 1/n, ..., n/n of the cache,
        each step taking the smallest that holds every live slot. Faster while sequences are
        short; above 1 results depend on the batch at the 1e-7 level, so 1 (the default) keeps
        runs bit for bit reproducible.
    decode_steps_per_call: decode steps per device call (K, sampler inside), for when the
        host's per-step work is a large part of a step. A request stopping inside a call holds
        its slot to the call's end (up to K - 1 steps dropped); admission waits for the call.
    pipeline_depth: decode calls in flight; the device runs depth - 1 calls ahead of the host's
        bookkeeping. Deeper absorbs host hiccups, at one more dropped step per request that
        stops on a token. 1: launch and wait.
    cache_dtype: the KV cache's dtype; None: the model's compute dtype.
    swap_space_gib: host memory for evicted idle sessions' caches, written back when their next
        turn is admitted, so it prefills only new tokens (bit for bit the same results).
        0 (the default): off, an evicted session's next turn prefills its whole context.
        Paged: the blocks of the least recently used idle session, when the pool runs short,
        are copied out before they are freed.
    parked_slots: rows of a second device cache holding evicted sessions' caches, moved in and
        out in one call per admission pass; when full, the oldest goes to host swap if on, else
        is dropped. Costs a slot's cache of device memory per row. 0 (the default): off.
    on_weight_update: "continue" keeps in-flight sequences going on the new weights (each token
        records its version); "abort" restarts them on the new weights.
    seed: the engine's stream of seeds for requests that bring none.
    keep_host_memory: on the CPU backend, make the C library keep freed memory and serve large
        buffers from its heap, so each step's temporaries reuse mapped pages instead of
        faulting in fresh ones (`host_memory.py`); process-wide, and resident memory stays at
        its peak. No effect on other backends.
    """

    max_slots: int = 8
    max_len: int = 1024
    kv_layout: KVLayout = "dense"
    block_size: int = 16
    kv_cache_tokens: int | None = None
    prefix_cache: bool = True
    prefill_chunks: tuple[int, ...] = (16, 64, 256)
    prefill_budget: int = 256
    prefill_rows: int = 1
    decode_buckets: int = 1
    decode_steps_per_call: int = 1
    pipeline_depth: int = 2
    cache_dtype: CacheDtype | None = None
    swap_space_gib: float = 0.0
    parked_slots: int = 0
    on_weight_update: WeightUpdateMode = "continue"
    seed: int = 0
    keep_host_memory: bool = True

    def __post_init__(self) -> None:
        owner = "EngineConfig"
        check_ints(owner, self, ("max_slots", "prefill_budget", "prefill_rows", "decode_buckets",
                                 "decode_steps_per_call", "pipeline_depth"))
        check_int(owner, "max_len", self.max_len, low=2)  # a prompt token and a generated one
        chunks = tuple(self.prefill_chunks)
        check(bool(chunks) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 1
                                   for c in chunks),
              owner, "prefill_chunks", self.prefill_chunks, "a non-empty list of ints >= 1")
        object.__setattr__(self, "prefill_chunks", chunks)
        check(self.cache_dtype is None or self.cache_dtype in get_args(CacheDtype), owner,
              "cache_dtype", self.cache_dtype, f"null or one of {get_args(CacheDtype)}")
        swap = self.swap_space_gib
        check(not isinstance(swap, bool) and isinstance(swap, int | float) and 0 <= swap < 1e6,
              owner, "swap_space_gib", swap, "a number of GiB >= 0 (0 turns session swapping off)")
        check_int(owner, "parked_slots", self.parked_slots, low=0)
        check_choice(owner, "on_weight_update", self.on_weight_update, WeightUpdateMode)
        check(isinstance(self.seed, int) and not isinstance(self.seed, bool), owner, "seed",
              self.seed, "an int")
        check_choice(owner, "kv_layout", self.kv_layout, KVLayout)
        check_int(owner, "block_size", self.block_size, low=1)
        for name in ("prefix_cache", "keep_host_memory"):
            check(isinstance(getattr(self, name), bool), owner, name, getattr(self, name),
                  "true or false")
        if self.kv_cache_tokens is not None:
            check_int(owner, "kv_cache_tokens", self.kv_cache_tokens,
                      low=-(-self.max_len // self.block_size) * self.block_size)
        if self.kv_layout == "paged":
            check(self.parked_slots == 0, owner, "parked_slots", self.parked_slots,
                  "0 with kv_layout 'paged' (idle sessions keep their blocks)")

    @property
    def blocks_per_sequence(self) -> int:
        """Block-table entries of one sequence: blocks holding max_len positions."""
        return -(-self.max_len // self.block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks in the paged pool."""
        tokens = (self.max_slots * self.max_len if self.kv_cache_tokens is None
                  else self.kv_cache_tokens)
        return max(tokens // self.block_size, self.blocks_per_sequence)

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """The distinct prefill chunk lengths actually compiled, ascending."""
        return tuple(sorted({min(c, self.max_len) for c in self.prefill_chunks}))

    @property
    def prefill_row_counts(self) -> tuple[int, ...]:
        """The row counts prefill is compiled for, ascending: powers of two below
        `prefill_rows` (at most `max_slots`), and that itself."""
        most = min(self.prefill_rows, self.max_slots)
        return tuple(sorted({1 << i for i in range(most.bit_length()) if 1 << i < most} | {most}))

    def prefill_row_count(self, rows: int) -> int:
        """The smallest compiled row count that holds `rows` rows."""
        return next(r for r in self.prefill_row_counts if r >= rows)

    @property
    def attention_lengths(self) -> tuple[int, ...]:
        """The cache prefixes decode is compiled to attend over, ascending (the last: all)."""
        L, n = self.max_len, self.decode_buckets
        return tuple(sorted({min(L, -(-L * i // n // 16) * 16) for i in range(1, n + 1)}))

    def attention_length(self, max_position: int) -> int:
        """The shortest compiled attention length that holds position `max_position`."""
        for length in self.attention_lengths:
            if length > max_position:
                return length
        return self.max_len

    def prefill_call_rows(self, remaining: Sequence[int | None]) -> list[tuple[int, int]]:
        """(index, tokens) of the waiting prompts that share the next prefill call, given each
        one's prompt tokens left to prefill in arrival order (None: may not share a call): the
        first one's next chunk and, up to the most compiled rows, the following ones whose
        next chunk has the same length."""
        most = self.prefill_row_counts[-1]
        rows: list[tuple[int, int]] = []
        size = 0
        for i, left in enumerate(remaining):
            if left is None:
                continue
            n, C = self.next_chunk(left)
            if rows and C != size:
                continue
            rows.append((i, n))
            size = C
            if len(rows) == most:
                break
        return rows

    def padded_size(self, n: int) -> int:
        """The smallest chunk length that holds `n` tokens (the largest if none does)."""
        sizes = self.chunk_sizes
        for size in sizes:
            if size >= n:
                return size
        return sizes[-1]

    def next_chunk(self, remaining: int) -> tuple[int, int]:
        """(tokens, chunk length) of the next prefill call for a prompt tail of `remaining`."""
        size = _plan(self.chunk_sizes, max(remaining, 1))[0]
        return min(size, remaining), size

    def prefill_plan(self, length: int) -> tuple[int, ...]:
        """The chunk lengths a prompt (tail) of `length` tokens is prefilled with, in order.

        The plan minimises the padded tokens plus `CALL_COST_TOKENS` per call: a device call
        costs about that many tokens' worth of time beyond its tokens (the weights are read
        once per call). Only the last chunk is padded.
        """
        return _plan(self.chunk_sizes, max(length, 1))


def kv_cache_tokens_for(model_cfg: ModelConfig, budget_bytes: int, *, dtype_bytes: int = 4,
                        block_size: int = 16) -> int:
    """The `kv_cache_tokens` whose blocks fit in `budget_bytes` of device memory: keys and
    values of every layer, `dtype_bytes` per element (4: float32, 2: bfloat16)."""
    per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * dtype_bytes
    blocks = budget_bytes // (per_token * block_size)
    if blocks < 1:
        raise ValueError(f"kv_cache_tokens_for: {budget_bytes} bytes hold no block of "
                         f"{block_size} positions ({per_token} bytes a position); valid: at "
                         f"least {per_token * block_size}")
    return blocks * block_size


# A prefill call's fixed cost in tokens of prefill time. Measured on the 2-core CPU with the
# engine benchmark's 32M model: a chunk of C tokens took about 6 ms + 0.18 ms x C (16: 8.9 ms,
# 64: 18.7 ms, 256: 51 ms), so a call costs about 32 tokens' worth beyond its tokens.
CALL_COST_TOKENS = 32


_PLANS: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}
_PLANS_LOCK = threading.Lock()  # engines' scheduler threads share the tables


def _plan(sizes: tuple[int, ...], length: int) -> tuple[int, ...]:
    """Cheapest chunk sequence covering `length` tokens (see `EngineConfig.prefill_plan`).

    Dynamic programming over the tail length, one table per set of sizes, grown on demand:
    cost[r] is the least cost of r tokens and first[r] the chunk that starts such a plan (the
    larger one on ties: fewer calls)."""
    with _PLANS_LOCK:
        cost, first = _PLANS.setdefault(sizes, ([0], [0]))
        for r in range(len(cost), length + 1):
            c, neg = min((size + CALL_COST_TOKENS + cost[max(r - size, 0)], -size)
                         for size in sizes)
            cost.append(c)
            first.append(-neg)
    plan = []
    while length > 0:
        plan.append(first[length])
        length -= first[length]
    return tuple(plan)


__all__ = ["CacheDtype", "EngineConfig", "KVLayout", "WeightUpdateMode", "kv_cache_tokens_for"]
