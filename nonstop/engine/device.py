"""The engine's two jitted device functions and its KV cache.

- `prefill`: one chunk of one slot's prompt, int32[1, C] with C from `EngineConfig.chunk_sizes`;
  the final chunk samples the first generated token (`prefill_into` leaves it on the device for
  the next decode).
- `decode`: one token for every slot, int32[S] (or K steps per call, [K, S], with
  `steps_per_call`), attending over the first `attend_len` positions of the cache, one
  compilation per length in `EngineConfig.attention_lengths`.

Both take the weights as an argument (a weight update never recompiles), donate the cache and
sample on device; trace counts are reported by `Engine.stats()`. Details: docs/engine.md,
"Inside the engine".
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array, lax

from nonstop.engine.placement import cache_sharding, replicated, weight_shardings
from nonstop.engine.sampling import sample
from nonstop.models import Decoder, KVCache
from nonstop.models.decoder import PagedKVCache
from nonstop.models.multimodal import Gemma3VLM


class SamplingArrays(NamedTuple):
    """Per-row sampling settings: temperature f32, top_k i32, top_p f32, seeds u32, steps i32."""

    temperature: Array | np.ndarray
    top_k: Array | np.ndarray
    top_p: Array | np.ndarray
    seeds: Array | np.ndarray
    steps: Array | np.ndarray


class StepOutput(NamedTuple):
    """Per-row sampled token int32, its logprob and its sampling logprob (float32)."""

    tokens: Array | np.ndarray
    logprobs: Array | np.ndarray
    sampling_logprobs: Array | np.ndarray


def _sample_into(logits: Array, sampling: SamplingArrays, first: Array, targets: Array
                 ) -> tuple[StepOutput, Array]:
    """Sample each row's next token (inside a prefill's jit), and write it into `first` at slot
    `targets[r]` (a target past the end, for rows whose prompt is not done, writes nothing)."""
    out = StepOutput(*sample(logits, *sampling))
    return out, first.at[targets].set(out.tokens, mode="drop")


def _copy_rows(src: Array, dst: Array, n: Array, rows_from: Array, rows_to: Array) -> Array:
    """`dst` with row `rows_to[i]` set to `src[rows_from[i]]` for each i < n, one at a time."""
    def copy(i: Array, dst: Array) -> Array:
        return lax.dynamic_update_index_in_dim(
            dst, lax.dynamic_index_in_dim(src, rows_from[i], 0, False), rows_to[i], 0)

    return lax.fori_loop(0, n, copy, dst)


class DeviceSteps:
    """The jitted prefill and decode of one model, with a trace counter per function."""

    def __init__(self, model: Decoder | Gemma3VLM, *, num_slots: int, max_len: int,
                 cache_dtype: jnp.dtype | None = None,
                 mesh: jax.sharding.Mesh | None = None, steps_per_call: int = 1,
                 parked_slots: int = 0, num_blocks: int | None = None, block_size: int = 16
                 ) -> None:
        # Paged layout (`num_blocks` set): the cache is a pool of blocks and every call takes
        # its rows' block tables int32[rows, blocks_per_sequence] (`paged.py`).
        self.paged = num_blocks is not None
        if self.paged and mesh is not None:
            raise ValueError("kv_layout 'paged' does not run on an engine mesh (disaggregated "
                             "mode) yet; use kv_layout 'dense' there")
        self.num_blocks, self.block_size = num_blocks or 0, block_size
        self.blocks_per_sequence = -(-max_len // block_size)
        # Where idle rows are parked: a position no row holds, whose writes are dropped.
        self.park_position = self.blocks_per_sequence * block_size if self.paged else max_len
        self.graphdef, state = nnx.split(model)
        # Commit every input to its device: jit keys its cache on committedness, so an
        # uncommitted first argument (fresh `jnp.zeros`) would compile a second time later.
        # With a `mesh` (disaggregated mode, `placement.py`) weights and cache live on the
        # engine's own devices, wherever the model was built; updates are resharded onto them.
        self.shardings = (jax.tree.map(lambda x: x.sharding, state) if mesh is None
                          else weight_shardings(state, mesh))
        self.initial_state = self.place(state, copy=False)
        self.cache_sharding = (
            jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if mesh is None
            else cache_sharding(model.cfg, num_slots=num_slots, max_len=max_len, mesh=mesh))
        self.pool_sharding = (
            self.cache_sharding if mesh is None
            else cache_sharding(model.cfg, num_slots=max(parked_slots, 1), max_len=max_len,
                                mesh=mesh))
        self.parked_slots = parked_slots
        self.cfg = model.cfg
        # Where sampled tokens land (and so `new_first`): the logits' device, or replicated
        # over the engine's mesh (the steps' pinned output sharding).
        self._first_sharding = (jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
                                if mesh is None else replicated(mesh))
        self.num_slots = num_slots
        self.max_len = max_len
        self.cache_dtype = cache_dtype or model.dtype
        self.steps_per_call = steps_per_call
        # The stand-in for "no previous step" is placed as the tokens it stands for, or jit
        # would compile a second variant.
        self._no_previous = jax.device_put(np.zeros((steps_per_call, num_slots), np.int32),
                                           self._first_sharding)
        self.traces: collections.Counter[str] = collections.Counter()
        # On a mesh, pin the cache's layout so a step never hands the next one a new sharding
        # (its other outputs, sampled tokens and `first`, replicated).
        def pinned(replicated_outputs: int) -> dict[str, Any]:
            return {} if mesh is None else {"out_shardings": (
                self.cache_sharding, *[replicated(mesh)] * replicated_outputs)}
        # The jitted steps take the weights as a flat list of arrays: flattening an nnx.State
        # costs ~30 us per call on the host (measured: decode dispatch 125 -> 84 us), so it is
        # done once per weight version (`_leaves`) and undone inside the trace.
        self._treedef = jax.tree.structure(self.initial_state)
        self._flat: tuple[nnx.State, list[Array]] | None = None
        self._decode_jit = jax.jit(self._with_state(self._decode_fn), donate_argnums=(1,),
                                   static_argnames=("attend_len",), **pinned(1))
        self._prefill_jit = jax.jit(self._with_state(self._prefill_fn), donate_argnums=(1,),
                                    **pinned(2))
        # Vision-language models: images are encoded once per request, and a prefill chunk that
        # holds image tokens takes their soft tokens row by row (see `prefill_images_into`).
        self.image_token_id = (model.vlm_cfg.image_token_id if isinstance(model, Gemma3VLM)
                               else None)
        if self.image_token_id is not None:
            self._encode_jit = jax.jit(self._with_state(self._encode_fn))
            self._prefill_images_jit = jax.jit(self._with_state(self._prefill_images_fn),
                                               donate_argnums=(1,))
        # Host swap of one slot's keys and values (an evicted session's cache, `read_slot` /
        # `write_slot`): the whole row, so the read is one compilation (the write two: rows
        # from the host, and rows still on the device).
        self._read_slot = jax.jit(self._read_slot_fn)
        # Parking (`EngineConfig.parked_slots`): idle sessions' rows moved between the cache
        # and a second, decode-free cache on the device, every move of an admission pass in
        # one call (`park`), one compilation.
        self._park = jax.jit(
            self._park_fn, donate_argnums=(0, 1),
            **({} if mesh is None else {"out_shardings": (self.cache_sharding,
                                                          self.pool_sharding)}))
        self._write_slot = jax.jit(
            self._write_slot_fn, donate_argnums=(0,),
            **({} if mesh is None else {"out_shardings": self.cache_sharding}))
        # Paged host swap: an idle session's blocks read out and written back into others, the
        # block ids padded to a table's length (one compilation each; padding reads clip and
        # writes drop).
        self._read_blocks = jax.jit(self._read_blocks_fn)
        self._write_blocks = jax.jit(self._write_blocks_fn, donate_argnums=(0,))

    def _with_state(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn(state, ...)` as a function of the state's flat leaves (see `_leaves`)."""
        def flat_fn(leaves: list[Array], *args: Any, **kwargs: Any) -> Any:
            return fn(jax.tree.unflatten(self._treedef, leaves), *args, **kwargs)
        return flat_fn

    def _leaves(self, state: nnx.State) -> list[Array]:
        """`state`'s leaves, flattened once per state object (the engine replaces its state
        wholesale on a weight update and never changes one in place)."""
        if self._flat is None or self._flat[0] is not state:
            leaves, treedef = jax.tree.flatten(state)
            if treedef != self._treedef:
                raise ValueError("these weights are not structured like the engine's model; "
                                 "see DeviceSteps.check_state")
            self._flat = (state, leaves)
        return self._flat[1]

    def _decode(self, state: nnx.State, cache: KVCache, *args: Any, attend_len: int
                ) -> tuple[KVCache, StepOutput]:
        return self._decode_jit(self._leaves(state), cache, *args, attend_len=attend_len)

    def _prefill(self, state: nnx.State, cache: KVCache, *args: Any
                 ) -> tuple[KVCache, StepOutput, Array]:
        return self._prefill_jit(self._leaves(state), cache, *args)

    def _prefill_images(self, state: nnx.State, cache: KVCache, *args: Any
                        ) -> tuple[KVCache, StepOutput, Array]:
        return self._prefill_images_jit(self._leaves(state), cache, *args)

    def _encode(self, state: nnx.State, images: np.ndarray) -> Array:
        return self._encode_jit(self._leaves(state), images)

    def new_cache(self) -> KVCache | PagedKVCache:
        if self.paged:
            return PagedKVCache.create(self.cfg, num_blocks=self.num_blocks,
                                       block_size=self.block_size, dtype=self.cache_dtype,
                                       sharding=self.cache_sharding)
        return KVCache.create(self.cfg, num_slots=self.num_slots, max_len=self.max_len,
                              dtype=self.cache_dtype, sharding=self.cache_sharding)

    def new_pool(self) -> KVCache:
        """The parking cache: `parked_slots` rows shaped like the cache's (zeros)."""
        return KVCache.create(self.cfg, num_slots=self.parked_slots, max_len=self.max_len,
                              dtype=self.cache_dtype, sharding=self.pool_sharding)

    def _park_fn(self, cache: KVCache, pool: KVCache, counts: Array, out_slots: Array,
                 out_rows: Array, in_rows: Array, in_slots: Array) -> tuple[KVCache, KVCache]:
        self.traces["park"] += 1

        def move(c: Array, p: Array) -> tuple[Array, Array]:
            # A loop over the moves there are (`counts`: outs, ins), one row each, in place:
            # one compilation for any count, nothing spent on padding (a padded scatter took
            # 0.65 ms for 9-16 moves where this takes 0.34 ms for 9). Out, then back in: each
            # update follows the read of its array by data dependence, so both run in place
            # (reading the parking rows before filling others would make XLA copy the whole
            # parking cache each call: measured 3 ms against 34 us for 1024 rows). A slot can
            # give its row and take another back in one call; the rows filled and the rows
            # moved back must differ.
            p = _copy_rows(c, p, counts[0], out_slots, out_rows)
            return _copy_rows(p, c, counts[1], in_rows, in_slots), p

        keys = [move(c, p) for c, p in zip(cache.keys, pool.keys, strict=True)]
        values = [move(c, p) for c, p in zip(cache.values, pool.values, strict=True)]
        return (KVCache(keys=tuple(c for c, _ in keys), values=tuple(c for c, _ in values)),
                KVCache(keys=tuple(p for _, p in keys), values=tuple(p for _, p in values)))

    def warmup_park(self, cache: KVCache, pool: KVCache, *, swap: bool = False
                    ) -> tuple[KVCache, KVCache]:
        """Compile `park` (moving nothing) and, with `swap`, the read of a parking row (a full
        parking cache's oldest goes to the host swap)."""
        cache, pool = jax.block_until_ready(self.park(cache, pool, [], []))
        if swap:
            jax.block_until_ready(self.start_read_slot(pool, 0))
        return cache, pool

    def park(self, cache: KVCache, pool: KVCache, outs: list[tuple[int, int]],
             ins: list[tuple[int, int]]) -> tuple[KVCache, KVCache]:
        """One call that copies cache slot s into pool row r for each (s, r) of `outs`, then
        pool row r into cache slot s for each (r, s) of `ins` (a slot may appear in both: its
        old row goes out; no row may appear in both; at most `num_slots` of each). Donates
        both; does not wait."""
        S = self.num_slots
        if len(outs) > S or len(ins) > S:
            raise ValueError(f"park: {len(outs)} rows out and {len(ins)} in; at most "
                             f"num_slots={S} of each in one call")
        moves = np.zeros((4, S), np.int32)
        if outs:
            moves[0:2, :len(outs)] = np.asarray(outs, np.int32).T
        if ins:
            moves[2:4, :len(ins)] = np.asarray(ins, np.int32).T
        counts = np.array([len(outs), len(ins)], np.int32)
        return self._park(cache, pool, counts, *moves)

    def place(self, state: nnx.State, *, copy: bool) -> nnx.State:
        """`state` committed to the model's shardings (copied if `copy`)."""
        return jax.device_put(state, self.shardings, may_alias=not copy)

    def _decode_fn(self, state: nnx.State, cache: KVCache, tables: Array | None, tokens: Array,
                   positions: Array, previous: Array, from_previous: Array,
                   sampling: SamplingArrays, attend_len: int) -> tuple[KVCache, StepOutput]:
        """`steps_per_call` decode steps, each sampling inside the call (one dispatch a call,
        not one for the model and one for the sampler); `previous` is the last call's tokens
        [K, S]."""
        K = self.steps_per_call
        self.traces[f"decode_{attend_len}" if K == 1 else f"decode_{K}x{attend_len}"] += 1
        tokens = jnp.where(from_previous, previous[-1], tokens)
        model = nnx.merge(self.graphdef, state)
        parked = positions >= self.max_len
        ones = jnp.ones((tokens.shape[0], 1), jnp.int32)
        if tables is not None:
            cache = cache.with_tables(tables)

        def step(carry: tuple[KVCache, Array], k: Array) -> tuple[tuple[KVCache, Array],
                                                                  StepOutput]:
            cache, fed = carry
            # Parked slots stay parked; a live slot that runs past the cache writes nothing
            # (the host has finished it with "cache_full" before any such token counts).
            at = jnp.where(parked, self.park_position, positions + k)
            h, cache = model.hidden_states(model.embed_tokens(fed[:, None]), at[:, None], ones,
                                           cache, None, attend_len=attend_len)
            out = StepOutput(*sample(model.logits(h)[:, 0], sampling.temperature,
                                     sampling.top_k, sampling.top_p, sampling.seeds,
                                     sampling.steps + k))
            return (cache, out.tokens), out

        (cache, _), outs = jax.lax.scan(step, (cache, tokens), jnp.arange(K, dtype=jnp.int32))
        return _at_rest(cache), outs

    def _prefill_fn(self, state: nnx.State, cache: KVCache, tables: Array | None, tokens: Array,
                    starts: Array, lengths: Array, slots: Array, sampling: SamplingArrays,
                    first: Array, targets: Array) -> tuple[KVCache, StepOutput, Array]:
        R, C = tokens.shape
        self.traces[f"prefill_{C}" if R == 1 else f"prefill_{R}x{C}"] += 1
        model = nnx.merge(self.graphdef, state)
        idx = jnp.arange(C, dtype=jnp.int32)[None, :]
        # Past a row's length (and on padding rows, length 0) positions are parked at the end
        # of the cache, where writes are dropped.
        positions = jnp.where(idx < lengths[:, None], starts[:, None] + idx, self.park_position)
        if tables is not None:
            cache = cache.with_tables(tables)
        h, cache = model.hidden_states(model.embed_tokens(tokens), positions,
                                       jnp.ones_like(tokens), cache, slots)
        last = h[jnp.arange(R), jnp.maximum(lengths - 1, 0)]  # [R, D]
        return _at_rest(cache), *_sample_into(model.logits(last[:, None])[:, 0], sampling, first, targets)

    def _read_slot_fn(self, cache: KVCache, slot: Array) -> Array:
        self.traces["read_slot"] += 1
        return jnp.stack([jnp.stack([k[slot] for k in cache.keys]),
                          jnp.stack([v[slot] for v in cache.values])])

    def _write_slot_fn(self, cache: KVCache, slot: Array, kv: Array) -> KVCache:
        self.traces["write_slot"] += 1
        return KVCache(keys=tuple(c.at[slot].set(kv[0, i].astype(c.dtype))
                                  for i, c in enumerate(cache.keys)),
                       values=tuple(c.at[slot].set(kv[1, i].astype(c.dtype))
                                    for i, c in enumerate(cache.values)))

    def start_read_slot(self, cache: KVCache, slot: int) -> Array:
        """Launch a copy of `slot`'s keys and values as one array [2, layers, K, max_len, H]
        (keys, then values; the whole row) and start moving it to the host, without waiting:
        the device array comes back at once (`slot_to_host` takes it once it is ready;
        `write_slot` takes it as it is). The copy is of the cache as it stands after the calls
        launched before it; the cache itself is not changed."""
        kv = self._read_slot(cache, np.int32(slot))
        kv.copy_to_host_async()
        return kv

    @staticmethod
    def slot_to_host(kv: Array, length: int) -> np.ndarray:
        """The first `length` positions of a row from `start_read_slot`, as a host copy
        [2, layers, K, length, H] (waits for it if it is not ready yet)."""
        return np.array(np.asarray(kv)[:, :, :, :length])

    def read_slot(self, cache: KVCache, slot: int, length: int) -> np.ndarray:
        """The keys and values of `slot`'s first `length` positions on the host, as
        [2, layers, K, length, H] (keys, then values; a copy, the cache is not changed).
        Waits for them."""
        return self.slot_to_host(self.start_read_slot(cache, slot), length)

    def write_slot(self, cache: KVCache, slot: int, kv: np.ndarray | Array) -> KVCache:
        """`cache` with `slot`'s first positions set to `kv`: a host array from `read_slot` /
        `slot_to_host` (the rest of the row zeroed), or the device row of `start_read_slot`
        as it is. Donates `cache`; does not wait."""
        if not isinstance(kv, jax.Array):
            row = np.zeros((*kv.shape[:3], self.max_len, kv.shape[4]), kv.dtype)
            row[:, :, :, :kv.shape[3]] = kv
            kv = row
        return self._write_slot(cache, np.int32(slot), kv)

    def _read_blocks_fn(self, cache: PagedKVCache, ids: Array) -> Array:
        self.traces["read_blocks"] += 1
        return jnp.stack([jnp.stack([jnp.take(k, ids, axis=0, mode="clip") for k in cache.keys]),
                          jnp.stack([jnp.take(v, ids, axis=0, mode="clip")
                                     for v in cache.values])])

    def _write_blocks_fn(self, cache: PagedKVCache, ids: Array, kv: Array) -> PagedKVCache:
        self.traces["write_blocks"] += 1
        return PagedKVCache(
            keys=tuple(c.at[ids].set(kv[0, i].astype(c.dtype), mode="drop")
                       for i, c in enumerate(cache.keys)),
            values=tuple(c.at[ids].set(kv[1, i].astype(c.dtype), mode="drop")
                         for i, c in enumerate(cache.values)))

    def _block_ids(self, blocks: list[int]) -> np.ndarray:
        ids = np.full(self.blocks_per_sequence, self.num_blocks, np.int32)
        ids[:len(blocks)] = blocks
        return ids

    def start_read_blocks(self, cache: PagedKVCache, blocks: list[int]) -> Array:
        """Launch a copy of `blocks`' keys and values (at most a sequence's worth) as one array
        [2, layers, MB, K, bs, H] (the first len(blocks) entries are theirs) and start moving
        it to the host, without waiting (`blocks_to_host` takes it once ready, `write_blocks`
        as it is). The copy is of the cache after the calls launched before it."""
        kv = self._read_blocks(cache, self._block_ids(blocks))
        kv.copy_to_host_async()
        return kv

    def blocks_to_host(self, kv: Array, length: int) -> np.ndarray:
        """The blocks holding the first `length` positions of a `start_read_blocks` copy, on the
        host: [2, layers, blocks, K, bs, H] (waits for it if it is not ready yet)."""
        return np.array(np.asarray(kv)[:, :, :-(-length // self.block_size)])

    def write_blocks(self, cache: PagedKVCache, blocks: list[int], kv: np.ndarray | Array
                     ) -> PagedKVCache:
        """`cache` with `blocks` set to the first len(blocks) entries of `kv` (a host copy from
        `blocks_to_host`, or the device array of `start_read_blocks` as it is). Donates
        `cache`; does not wait."""
        if not isinstance(kv, jax.Array):
            full = np.zeros((*kv.shape[:2], self.blocks_per_sequence, *kv.shape[3:]), kv.dtype)
            full[:, :, :kv.shape[2]] = kv
            kv = full
        return self._write_blocks(cache, self._block_ids(blocks), kv)

    def block_bytes(self) -> int:
        """Host bytes of one block (keys and values, all layers)."""
        return self.block_size * self.slot_position_bytes()

    def slot_position_bytes(self) -> int:
        """Host bytes that one cached position of one slot takes (keys and values, all
        layers)."""
        itemsize = np.dtype(self.cache_dtype).itemsize
        return 2 * self.cfg.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim * itemsize

    def _encode_fn(self, state: nnx.State, images: Array) -> Array:
        self.traces[f"encode_images_{images.shape[0]}"] += 1
        return nnx.merge(self.graphdef, state).encode_images(images)

    def _prefill_images_fn(self, state: nnx.State, cache: KVCache, tables: Array | None,
                           tokens: Array, features: Array, lookahead: Array, start: Array, length: Array,
                           slot: Array, sampling: SamplingArrays, first: Array, targets: Array
                           ) -> tuple[KVCache, StepOutput, Array]:
        C = tokens.shape[1]
        self.traces[f"prefill_images_{C}"] += 1
        model = nnx.merge(self.graphdef, state)
        idx = jnp.arange(C, dtype=jnp.int32)
        positions = jnp.where(idx < length, start + idx, self.park_position)[None, :]
        if tables is not None:
            cache = cache.with_tables(tables)
        is_image = tokens == self.image_token_id
        x = model.embed_tokens(jnp.where(is_image, 0, tokens))
        x = jnp.where(is_image[..., None], features[None].astype(x.dtype), x)
        h, cache = model.hidden_states(x, positions, jnp.ones_like(tokens), cache, slot[None],
                                       lookahead)
        last = jax.lax.dynamic_index_in_dim(h[0], jnp.maximum(length - 1, 0), keepdims=True)
        return _at_rest(cache), *_sample_into(model.logits(last[None])[:, 0], sampling, first, targets)

    def encode_images(self, state: nnx.State, images: np.ndarray) -> np.ndarray:
        """Processed images float32[I, H, W, C] -> soft tokens float32[I * M, D] on the host."""
        feats = self._encode(state, images)
        return np.asarray(jax.device_get(feats), np.float32).reshape(-1, feats.shape[-1])

    def decode(self, state: nnx.State, cache: KVCache, tokens: np.ndarray,
               positions: np.ndarray, sampling: SamplingArrays, attend_len: int | None = None,
               previous: Array | None = None, from_previous: np.ndarray | None = None,
               tables: np.ndarray | None = None) -> tuple[KVCache, StepOutput]:
        """Feed tokens int32[S] (a host or device array; the scheduler passes `new_first`'s)
        at positions int32[S]; sample the next `steps_per_call` K tokens of every slot (each
        output [K, S]; K = 1: [1, S]).

        `attend_len` (a compiled length; default the whole cache) must exceed every position
        that matters this call. Rows where `from_previous` is true are fed `previous` instead
        (the device tokens of the call before, so they need not be read back first).
        Paged: `tables` int32[S, blocks_per_sequence] holds every slot's block table (rows of
        parked slots: anything)."""
        S = self.num_slots
        if previous is None:
            previous = self._no_previous
        if from_previous is None:
            from_previous = np.zeros(S, bool)
        return self._decode(state, cache, self._tables(tables, S), tokens, positions, previous,
                            from_previous, sampling, attend_len=attend_len or self.max_len)

    def _tables(self, tables: np.ndarray | None, rows: int) -> np.ndarray | None:
        """The block tables a call takes: None for the dense layout; for the paged one
        `tables` (or, for a warm-up, rows with no blocks) as int32[rows, MB]."""
        if not self.paged:
            if tables is not None:
                raise ValueError("block tables were passed to a dense-layout DeviceSteps")
            return None
        if tables is None:
            return np.full((rows, self.blocks_per_sequence), self.num_blocks, np.int32)
        return np.asarray(tables, np.int32)

    def prefill_into(self, state: nnx.State, cache: KVCache, tokens: np.ndarray,
                     starts: np.ndarray, lengths: np.ndarray, slots: np.ndarray,
                     sampling: SamplingArrays, first: Array, targets: np.ndarray,
                     tables: np.ndarray | None = None) -> tuple[KVCache, StepOutput, Array]:
        """`prefill`, with each row's sampled token also written into the device array `first`
        int32[S] at slot `targets[r]` (num_slots: nowhere), so the next decode can be fed it
        without the host reading it first (see `decode`). Returns the new `first`."""
        return self._prefill(state, cache, self._tables(tables, len(slots)), tokens,
                             np.asarray(starts, np.int32),
                             np.asarray(lengths, np.int32), np.asarray(slots, np.int32), sampling,
                             first, np.asarray(targets, np.int32))

    def prefill_images_into(self, state: nnx.State, cache: KVCache, tokens: np.ndarray,
                            features: np.ndarray, lookahead: np.ndarray, start: int,
                            length: int, slot: int, sampling: SamplingArrays, first: Array,
                            target: int, tables: np.ndarray | None = None
                            ) -> tuple[KVCache, StepOutput, Array]:
        """As `prefill_into` for one row, with image soft tokens features float32[C, D] at the
        image rows and lookahead int32[1, C] (image tokens see the rest of their image, all in
        this chunk)."""
        return self._prefill_images(state, cache, self._tables(tables, 1), tokens, features,
                                    lookahead, np.int32(start),
                                    np.int32(length), np.int32(slot), sampling, first,
                                    np.full(1, target, np.int32))

    def new_first(self) -> Array:
        """The device array of fresh slots' first tokens, int32[S] (zeros), placed as sampled
        tokens are (see `warmup`)."""
        return jax.device_put(np.zeros(self.num_slots, np.int32), self._first_sharding)

    def prefill(self, state: nnx.State, cache: KVCache, tokens: np.ndarray, starts: np.ndarray,
                lengths: np.ndarray, slots: np.ndarray, sampling: SamplingArrays,
                tables: np.ndarray | None = None) -> tuple[KVCache, StepOutput]:
        """Prefill R rows at once: row r's tokens int32[R, C] (its first `lengths[r]` real) at
        positions starts[r].. of slot `slots[r]`; samples each row's next token. A padding row
        has length 0 (it writes nothing; its sample is meaningless)."""
        R = len(slots)
        cache, out, _ = self.prefill_into(state, cache, tokens, starts, lengths, slots, sampling,
                                          self.new_first(), np.full(R, self.num_slots), tables)
        return cache, out

    def warmup(self, state: nnx.State, cache: KVCache, chunk_sizes: tuple[int, ...],
               attention_lengths: tuple[int, ...] = (), *, swap: bool = False,
               prefill_rows: tuple[int, ...] = (1,)) -> KVCache:
        """Compile decode for each attention length, prefill for each chunk size and row
        count and, with `swap`, the slot read and write; writes nothing (all rows parked,
        slot 0 rewritten with what it holds)."""
        S = self.num_slots
        sampling = idle_sampling(S)
        lengths = attention_lengths or (self.max_len,)
        # The scheduler feeds decode its fresh slots' tokens from the device (`new_first`) and
        # prefills through `prefill_into`: compile exactly those (a host array in their place
        # would key another compilation).
        first = self.new_first()
        for length in lengths:
            cache, out = self.decode(state, cache, first, np.full(S, self.max_len, np.int32),
                                     sampling, length)
            jax.block_until_ready(out)
        for R in prefill_rows:
            for C in chunk_sizes:
                cache, out, first = self.prefill_into(
                    state, cache, np.zeros((R, C), np.int32), np.full(R, self.max_len),
                    np.zeros(R), np.zeros(R), idle_sampling(R), first, np.full(R, S))
                jax.block_until_ready(out)
        if swap and self.paged:  # as below, for blocks
            kv = jax.block_until_ready(self.start_read_blocks(cache, []))
            cache = jax.block_until_ready(self.write_blocks(cache, [], kv))
            cache = jax.block_until_ready(self.write_blocks(cache, [], self.blocks_to_host(
                kv, self.block_size)))
        elif swap:  # a copy written back from the device as it is, and from the host
            kv = jax.block_until_ready(self.start_read_slot(cache, 0))
            cache = jax.block_until_ready(self.write_slot(cache, 0, kv))
            cache = jax.block_until_ready(self.write_slot(cache, 0, self.slot_to_host(
                kv, self.max_len)))
        return cache

    def check_state(self, state: nnx.State) -> None:
        """Raise ValueError unless `state` matches the model's parameters leaf for leaf."""
        ref_leaves, ref_tree = jax.tree.flatten(self.initial_state)
        leaves, tree = jax.tree.flatten(state)
        if tree != ref_tree:
            raise ValueError("update_weights: the parameters' structure differs from the "
                             f"engine model's: got {tree}, expected {ref_tree}")
        paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(self.initial_state)[0]]
        for path, new, ref in zip(paths, leaves, ref_leaves, strict=True):
            if np.shape(new) != np.shape(ref) or jnp.dtype(new.dtype) != jnp.dtype(ref.dtype):
                raise ValueError(f"update_weights: parameter {path} is {new.dtype}"
                                 f"{list(np.shape(new))}, the engine's is {ref.dtype}"
                                 f"{list(np.shape(ref))}; shapes and dtypes must match (a "
                                 "change would recompile)")


def _at_rest(cache: KVCache | PagedKVCache) -> KVCache | PagedKVCache:
    """The cache as a call returns it: a paged one without the call's block tables."""
    return cache.with_tables(None) if isinstance(cache, PagedKVCache) else cache


def idle_sampling(rows: int) -> SamplingArrays:
    """Greedy settings for `rows` rows (what parked slots carry)."""
    return SamplingArrays(np.zeros(rows, np.float32), np.zeros(rows, np.int32),
                          np.ones(rows, np.float32), np.zeros(rows, np.uint32),
                          np.zeros(rows, np.int32))


__all__ = ["DeviceSteps", "SamplingArrays", "StepOutput", "idle_sampling"]
