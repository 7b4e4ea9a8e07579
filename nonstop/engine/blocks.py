"""The paged KV cache's block pool: reference-counted blocks and the prefix cache over them.

The cache (`EngineConfig.kv_layout="paged"`) is `num_blocks` blocks of `block_size` positions;
each sequence holds a block table, its i-th block holding positions [i * bs, (i + 1) * bs).
A block is in exactly one of three states:

- held: referenced by one or more sequences (prompt blocks shared by several samples of one
  prompt, a session's blocks between turns, the blocks of a running request);
- cached: referenced by nobody but still keyed in the prefix cache (its keys and values are
  valid for the tokens its key names); taken back for reuse, least recently freed first,
  only when no free block is left;
- free: nothing in it matters.

Prefix-cache keys chain: a block's key hashes its parent's key, the policy version and its
tokens, so a hit on block i means the whole prefix up to and including it matches and was
computed by the same weights (`PrefixKey`). Only full blocks are keyed. Departure from vLLM: a
block that a sequence would write into while others share it is not copied on write; the
scheduler never writes into a shared block and instead recomputes the (< block_size) tokens
of a partly matching last block in a block of its own.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

PrefixKey = tuple[int, int, tuple[int, ...]]  # (parent key's hash, policy version, tokens)
ROOT_HASH = 0  # the parent hash of a sequence's first block


class BlockPool:
    """Reference-counted blocks with an LRU prefix cache; every method is O(blocks touched)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool: num_blocks={num_blocks}; valid: at least 1")
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        # Cached blocks (refcount 0, keyed), least recently released first.
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._block_of: dict[int, int] = {}  # key hash -> block
        self._key_of: dict[int, tuple[int, PrefixKey]] = {}  # block -> (its hash, its key)
        self.hits = 0  # blocks found by `lookup`
        self.evicted = 0  # cached blocks taken back for reuse

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now (free and cached)."""
        return len(self._free) + len(self._cached)

    @property
    def num_held(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks, each with one reference; None (and nothing taken) if fewer are
        available. Free blocks go first, then the least recently released cached ones."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                self._unkey(block)
                self.evicted += 1
            self.refs[block] = 1
            out.append(block)
        return out

    def share(self, block: int) -> None:
        """One more reference to a held or cached block."""
        if self.refs[block] == 0:
            if block not in self._cached:
                raise ValueError(f"BlockPool.share: block {block} is free; only held or "
                                 "cached blocks can be shared")
            del self._cached[block]
        self.refs[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; one left with none is cached if keyed, else free."""
        for block in blocks:
            if self.refs[block] <= 0:
                raise ValueError(f"BlockPool.release: block {block} is not held")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    # ---------------------------------------------------------------- prefix cache

    @staticmethod
    def key(parent_hash: int, version: int, tokens: Sequence[int]) -> tuple[int, PrefixKey]:
        """(hash, key) of a full block of `tokens` after the prefix whose last block's hash is
        `parent_hash` (`ROOT_HASH` for a first block), computed by weights `version`."""
        key = (parent_hash, version, tuple(tokens))
        return hash(key), key

    def register(self, block: int, hashed: tuple[int, PrefixKey]) -> bool:
        """Key a held block (its keys and values are, or are about to be, those of the key's
        tokens). False if the key already names another block, or the block has a key."""
        h, _ = hashed
        if self.refs[block] <= 0:
            raise ValueError(f"BlockPool.register: block {block} is not held")
        if h in self._block_of or block in self._key_of:
            return False
        self._block_of[h] = block
        self._key_of[block] = hashed
        return True

    def lookup(self, hashed: tuple[int, PrefixKey]) -> int | None:
        """The block keyed exactly so (held or cached), or None. Takes no reference."""
        h, key = hashed
        block = self._block_of.get(h)
        if block is None or self._key_of[block][1] != key:  # a hash collision is a miss
            return None
        self.hits += 1
        return block

    def unregister(self, block: int) -> None:
        """Forget a block's key (its contents will not be what the key says)."""
        if block in self._key_of:
            self._unkey(block)
            if self.refs[block] == 0:
                del self._cached[block]
                self._free.append(block)

    def clear_keys(self) -> None:
        """Forget every key (weights changed): cached blocks become free."""
        self._block_of.clear()
        self._key_of.clear()
        self._free.extend(self._cached)
        self._cached.clear()

    def is_keyed(self, block: int) -> bool:
        return block in self._key_of

    def _unkey(self, block: int) -> None:
        h, _ = self._key_of.pop(block)
        del self._block_of[h]

    def check(self) -> None:
        """Raise AssertionError unless every block is in exactly one state and the key maps
        agree (tests call this after every operation)."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & cached, "a block is both free and cached"
        for block in range(self.num_blocks):
            held = self.refs[block] > 0
            assert self.refs[block] >= 0
            assert held + (block in free) + (block in cached) == 1, f"block {block}'s state"
            assert block not in cached or block in self._key_of, "an unkeyed cached block"
            assert block not in free or block not in self._key_of, "a keyed free block"
        assert len(self._block_of) == len(self._key_of)
        for block, (h, _) in self._key_of.items():
            assert self._block_of[h] == block


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold `positions` positions."""
    return -(-positions // block_size)


__all__ = ["ROOT_HASH", "BlockPool", "PrefixKey", "blocks_for"]
