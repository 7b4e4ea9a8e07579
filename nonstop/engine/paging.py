"""The scheduler's side of the paged KV cache: slots' block tables, sessions' blocks, and the
prefix cache's pending blocks.

`PagedBlocks` owns the `BlockPool` and the host block tables int32[S, MB] every device call
takes. A slot's table covers its whole context once the request is admitted (`admit`) and
grows block by block while it decodes (`grow`). A request whose context starts with full
blocks another request has computed, or is computing, shares them (prefix cache: `admit`
looks the chained keys up). A block being computed by an admitted request that has not
prefilled it yet is *pending*: a request sharing it waits (`ready`) until its writer's prefill
has passed it; if the writer leaves first, the block loses its key and the requests that
share it are handed back to be restarted (`writer_gone`). Between turns a session keeps its
blocks (`Session.blocks`); the least recently used idle session's are freed when the pool runs
short (`free_idle`), first copied to host memory if `EngineConfig.swap_space_gib` allows
(`swap_out`), in which case its next turn gets new blocks with the copy written back
(`restore`) and prefills only its new tokens; else its next turn recomputes.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import numpy as np

from nonstop.engine.blocks import ROOT_HASH, BlockPool, PrefixKey, blocks_for
from nonstop.engine.config import EngineConfig
from nonstop.engine.requests import Counters, Request, Session


class PagedBlocks:
    """Block tables, sessions' blocks and pending prefix blocks of one scheduler."""

    def __init__(self, config: EngineConfig, num_slots: int, counters: Counters,
                 swap_out: Callable[[Session, list[int], list[int]], None] | None = None
                 ) -> None:
        self.config, self.counters = config, counters
        # (session, its blocks, the tokens they hold): copy them to the host before they are
        # freed (sets `session.swapped` if the budget allows).
        self.swap_out = swap_out
        # Set by `admit` for a session with a host copy: (session, the new blocks to write the
        # copy into; empty when none of it is reused). The caller writes it back and clears it.
        self.restore: tuple[Session, list[int]] | None = None
        self.bs = config.block_size
        self.pool = BlockPool(config.num_blocks)
        self.none = config.num_blocks  # a table entry with no block: writes are dropped
        self.tables = np.full((num_slots, config.blocks_per_sequence), self.none, np.int32)
        self.held: list[list[int]] = [[] for _ in range(num_slots)]
        # The policy version that computed all of a slot's keys and values (-1: mixed, or
        # none yet); only such blocks are keyed for the prefix cache.
        self.kv_version = [-1] * num_slots
        # Pending blocks: block -> (writer, its epoch, the prefill position that completes it).
        self.pending: dict[int, tuple[Request, int, int]] = {}
        # id(follower) -> (follower, the pending blocks' (writer, epoch, end) it waits for)
        self.waits: dict[int, tuple[Request, list[tuple[Request, int, int]]]] = {}
        self.idle: collections.OrderedDict[Session, None] = collections.OrderedDict()
        # Blocks kept free at admission for running sequences to grow into.
        self.watermark = max(1, config.num_blocks // 50)

    # ---------------------------------------------------------------- keys

    def keys(self, tokens: Sequence[int], version: int, n: int
             ) -> list[tuple[int, PrefixKey]]:
        """The chained prefix-cache keys of the first `n` full blocks of `tokens`."""
        out, parent = [], ROOT_HASH
        for i in range(n):
            hashed = BlockPool.key(parent, version, tokens[i * self.bs:(i + 1) * self.bs])
            out.append(hashed)
            parent = hashed[0]
        return out

    # ---------------------------------------------------------------- admission

    def admit(self, req: Request, slot: int, context: list[int], version: int, *,
              running: int, share: bool) -> int | None:
        """Give `slot` blocks for all of `context` (the request's prompt, and after a
        preemption its tokens so far); returns the positions already computed (a session's
        kept blocks or prefix-cache hits), or None if the pool cannot hold it even after
        freeing idle sessions (nothing changed then). `running`: requests in other slots
        (with none, the watermark is waived); `share`: look up and key prompt blocks."""
        session = req.session
        blocks: list[int] = []
        n = 0
        tokens: list[int] = []
        restoring = False  # the session's host copy is written into its first new blocks
        if session is not None and session.blocks is not None:
            blocks, tokens = session.blocks, session.kv_tokens
            self.idle.pop(session, None)
            session.blocks = None
            n = _common_prefix(tokens, context, len(context) - 1)
            # Never write into a block others share: recompute its tokens in a new one.
            if n % self.bs and self.pool.refs[blocks[n // self.bs]] > 1:
                n -= n % self.bs
            keep = blocks_for(n, self.bs)
            if n % self.bs:
                self.pool.unregister(blocks[n // self.bs])  # rewritten past n
            self.pool.release(blocks[keep:])
            blocks = blocks[:keep]
            self.kv_version[slot] = session.kv_version if n else version
        elif session is not None and session.swapped is not None:
            swapped = list(session.swapped.tokens)
            n = _common_prefix(swapped, context, len(context) - 1)
            restoring = n > 0
            self.kv_version[slot] = session.kv_version if n else version
        else:
            self.kv_version[slot] = version
        waits: list[tuple[Request, int, int]] = []
        if share and n == 0:
            full = (len(context) - 1) // self.bs  # at least one token is always computed
            for hashed in self.keys(context, version, full):
                block = self.pool.lookup(hashed)
                if block is None:
                    break
                self.pool.share(block)
                blocks.append(block)
                if block in self.pending:
                    writer, epoch, end = self.pending[block]
                    if writer.epoch == epoch and writer.slot >= 0 and writer.prefill_pos < end:
                        waits.append((writer, epoch, end))
            n = len(blocks) * self.bs
            self.counters.prefix_hit_tokens += n
        need = blocks_for(len(context), self.bs) - len(blocks)
        reserve = self.watermark if running else 0
        while self.pool.num_free < need + reserve and self.free_idle():
            pass
        new = self.pool.allocate(need) if self.pool.num_free >= need + reserve else None
        if new is None:
            if session is not None and tokens:
                session.blocks, session.kv_tokens = blocks, tokens[:n]
                self.idle[session] = None
            else:
                self.pool.release(blocks)
            return None
        if session is not None and session.swapped is not None:
            self.restore = (session, new[:blocks_for(n, self.bs)] if restoring else [])
        if share and self.kv_version[slot] == version:
            # Only blocks whose whole prefix the current weights computed are keyed. Restored
            # blocks hold their copy's tokens once written back: not keyed here.
            first = len(blocks)  # table index of new[0]
            start = first + (blocks_for(n, self.bs) if restoring else 0)
            for i, hashed in enumerate(self.keys(context, version, len(context) // self.bs)):
                if i >= start and self.pool.register(new[i - first], hashed):
                    self.pending[new[i - first]] = (req, req.epoch, (i + 1) * self.bs)
        self._set(slot, blocks + new)
        if waits:
            self.waits[id(req)] = (req, waits)
        return n

    def ready(self, req: Request) -> bool:
        """Whether every pending block `req` shares has been computed by its writer."""
        entry = self.waits.get(id(req))
        if entry is None:
            return True
        if all(w.prefill_pos >= end or w.epoch != e for w, e, end in entry[1]):
            del self.waits[id(req)]
            return True
        return False

    def writer_gone(self, req: Request) -> list[Request]:
        """`req` leaves its slot: the pending blocks it had not computed lose their keys;
        returns the requests sharing them, which must restart."""
        self.waits.pop(id(req), None)
        lost = [b for b, (w, _, end) in self.pending.items()
                if w is req and w.prefill_pos < end]
        for block in [b for b, (w, _, _) in self.pending.items() if w is req]:
            del self.pending[block]
        for block in lost:
            self.pool.unregister(block)
        if not lost:
            return []
        return [f for f, waits in self.waits.values() if any(w is req for w, _, _ in waits)]

    # ---------------------------------------------------------------- growth and release

    def grow(self, slot: int, positions: int) -> bool:
        """Blocks for `slot`'s first `positions` positions (capped at the table); False if
        the pool has none left even after freeing idle sessions."""
        need = blocks_for(min(positions, self.tables.shape[1] * self.bs), self.bs) - len(
            self.held[slot])
        if need <= 0:
            return True
        while self.pool.num_free < need and self.free_idle():
            pass
        new = self.pool.allocate(need)
        if new is None:
            return False
        self._set(slot, self.held[slot] + new)
        return True

    def release(self, slot: int, tokens: list[int], version: int, *,
                session: Session | None, share: bool) -> None:
        """A request leaves `slot` whose cache holds `tokens`: its full blocks are keyed for
        the prefix cache (if all computed by `version`); a session keeps the blocks, else
        they go back to the pool."""
        keep = blocks_for(len(tokens), self.bs)
        self.pool.release(self.held[slot][keep:])  # taken ahead for tokens never computed
        blocks = self.held[slot][:keep]
        pure = self.kv_version[slot] == version
        if share and pure:
            for block, hashed in zip(blocks, self.keys(tokens, version, len(tokens) // self.bs),
                                     strict=False):
                self.pool.register(block, hashed)
        self._set(slot, [])
        if session is not None and not session.closed and tokens:
            session.blocks, session.kv_tokens = blocks, list(tokens)
            session.kv_version = self.kv_version[slot] if pure else -1
            self.idle[session] = None
        else:
            self.pool.release(blocks)

    def drop_session(self, session: Session) -> None:
        """Give a closed (or evicted) session's blocks back."""
        self.idle.pop(session, None)
        if session.blocks is not None:
            self.pool.release(session.blocks)
            session.blocks, session.kv_tokens = None, []

    def free_idle(self) -> bool:
        """Free the least recently used idle session's blocks (copied to the host first if
        swapping is on, else its next turn recomputes); False if there is none."""
        if not self.idle:
            return False
        session = next(iter(self.idle))
        if self.swap_out is not None and session.blocks:
            self.swap_out(session, session.blocks, session.kv_tokens)
        self.drop_session(session)
        self.counters.evictions += 1
        return True

    def weights_changed(self) -> None:
        """Nothing computed so far may be found again, nor keyed later by running slots."""
        self.pool.clear_keys()
        self.pending.clear()
        self.kv_version = [-1] * len(self.kv_version)
        for session in self.idle:
            session.kv_version = -1

    def _set(self, slot: int, blocks: list[int]) -> None:
        self.held[slot] = blocks
        self.tables[slot] = self.none
        self.tables[slot, :len(blocks)] = blocks


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit], strict=False):
        if x != y:
            break
        n += 1
    return n


__all__ = ["PagedBlocks"]
