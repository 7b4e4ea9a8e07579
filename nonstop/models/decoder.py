"""The decoder-only transformer shared by every family, and its KV cache.

`Decoder(cfg, rngs=...)` is a Flax NNX module. Call it three ways:

    logits, _ = model(tokens)                                   # full forward [B, T]
    logits, _ = model(tokens, positions, segment_ids)           # packed rows, 0 = padding
    logits, cache = model(tokens, positions, cache=cache)       # rows are the cache's slots
    logits, cache = model(tokens, positions, cache=cache, slots=jnp.array([s]))  # some slots

With a cache, each row writes its keys and values at its `positions` in its slot and attends to
that slot's positions <= its own; a position >= the cache length writes nothing (the engine
parks idle slots there). Logits are float32. A `PagedKVCache` (a pool of blocks, with the rows'
block tables) takes the place of a `KVCache` the same way; `slots` is then unused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax import Array

from nonstop.models.config import LayerType, ModelConfig
from nonstop.models.layers import Block, RMSNorm, _param, softcap
from nonstop.models.lora import dense
from nonstop.models.paged import PagedLayer
from nonstop.models.rope import inverse_frequencies, rope_angles


@struct.dataclass
class KVCache:
    """Per-layer keys and values, each [S, K, L, H] (slots, kv heads, length, head dim)."""

    keys: tuple[Array, ...]
    values: tuple[Array, ...]

    @classmethod
    def create(cls, cfg: ModelConfig, *, num_slots: int, max_len: int,
               dtype: jnp.dtype = jnp.float32, sharding: jax.sharding.Sharding | None = None
               ) -> KVCache:
        shape = (num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)

        def zeros() -> Array:
            z = jnp.zeros(shape, dtype)
            return jax.device_put(z, sharding) if sharding is not None else z

        return cls(keys=tuple(zeros() for _ in range(cfg.num_layers)),
                   values=tuple(zeros() for _ in range(cfg.num_layers)))

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    @staticmethod
    def logical_axes() -> tuple[str | None, ...]:
        return ("cache_slots", "kv_heads", "cache_len", "head_dim")


@struct.dataclass
class PagedKVCache:
    """Per-layer pools of keys and values, each [NB, K, bs, H] (blocks, kv heads, block size,
    head dim), and the rows' block tables int32[B, MB] for the call at hand (None at rest):
    row b's position p lives in block tables[b, p // bs] (`paged.py`)."""

    keys: tuple[Array, ...]
    values: tuple[Array, ...]
    tables: Array | None = None

    @classmethod
    def create(cls, cfg: ModelConfig, *, num_blocks: int, block_size: int,
               dtype: jnp.dtype = jnp.float32, sharding: jax.sharding.Sharding | None = None
               ) -> PagedKVCache:
        shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)

        def zeros() -> Array:
            z = jnp.zeros(shape, dtype)
            return jax.device_put(z, sharding) if sharding is not None else z

        return cls(keys=tuple(zeros() for _ in range(cfg.num_layers)),
                   values=tuple(zeros() for _ in range(cfg.num_layers)))

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.keys[0].shape[2]

    def with_tables(self, tables: Array | None) -> PagedKVCache:
        return PagedKVCache(keys=self.keys, values=self.values, tables=tables)


class Decoder(nnx.Module):
    """Embeddings, `num_layers` blocks, final norm and the (tied or separate) output head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32,
                 param_dtype: jnp.dtype = jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                            param_dtype)
        self.layers = nnx.List([
            Block(cfg, t, param_dtype=param_dtype, rngs=rngs) for t in cfg.layer_types
        ])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, plus_one=cfg.norm_plus_one,
                            param_dtype=param_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                  param_dtype)
        # Static (hashable) so NNX treats it as structure, not as a parameter.
        self._inv_freq = {t: tuple(inverse_frequencies(cfg.rope_for(t), cfg.head_dim).tolist())
                          for t in ("full", "sliding")}

    def embed_tokens(self, tokens: Array) -> Array:
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)
        if self.cfg.scale_embeddings:
            x = x * jnp.asarray(self.cfg.hidden_size**0.5, dtype=self.dtype)
        return x

    def hidden_states(self, x: Array, positions: Array, segment_ids: Array,
                      cache: KVCache | PagedKVCache | None, slots: Array | None,
                      lookahead: Array | None = None, attend_len: int | None = None
                      ) -> tuple[Array, KVCache | PagedKVCache | None]:
        """Run the blocks and the final norm over input embeddings x [B, T, D].

        `lookahead` int32[B, T]: extra following keys each query may see; `attend_len`: attend
        over the cache's first positions only (both: see `Attention`)."""
        # In layer-type order, not set order: every process traces the same HLO.
        ropes: dict[LayerType, tuple[Array, Array]] = {
            t: rope_angles(positions, np.asarray(self._inv_freq[t], np.float32))
            for t in dict.fromkeys(self.cfg.layer_types)
        }
        new_keys, new_values = [], []
        for i, block in enumerate(self.layers):
            layer_cache: tuple[Array, Array] | PagedLayer | None = None
            if isinstance(cache, PagedKVCache):
                assert cache.tables is not None, "a paged cache needs the rows' block tables"
                layer_cache = PagedLayer(cache.keys[i], cache.values[i], cache.tables)
            elif cache is not None:
                layer_cache = (cache.keys[i], cache.values[i])
            x, layer_cache = block(x, ropes[block.layer_type], positions, segment_ids,
                                   layer_cache, slots, lookahead, attend_len)
            if layer_cache is not None:
                new_keys.append(layer_cache[0])
                new_values.append(layer_cache[1])
        new_cache: KVCache | PagedKVCache | None = None
        if isinstance(cache, PagedKVCache):
            new_cache = PagedKVCache(keys=tuple(new_keys), values=tuple(new_values),
                                     tables=cache.tables)
        elif cache is not None:
            new_cache = KVCache(keys=tuple(new_keys), values=tuple(new_values))
        return self.norm(x), new_cache

    def logits(self, h: Array) -> Array:
        """float32 logits [B, T, V] from final hidden states [B, T, D]."""
        head = (self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...])
        out = dense(h, head.astype(h.dtype), 1)
        return softcap(out.astype(jnp.float32), self.cfg.final_softcap)

    def __call__(self, tokens: Array, positions: Array | None = None,
                 segment_ids: Array | None = None, *, cache: KVCache | None = None,
                 slots: Array | None = None) -> tuple[Array, KVCache | None]:
        """tokens int32[B, T] -> (float32 logits [B, T, V], updated cache or None)."""
        B, T = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if segment_ids is None:
            segment_ids = jnp.ones((B, T), jnp.int32)
        h, cache = self.hidden_states(self.embed_tokens(tokens), positions, segment_ids, cache,
                                      slots)
        return self.logits(h), cache


def init_decoder(cfg: ModelConfig, *, seed: int = 0, dtype: jnp.dtype = jnp.float32,
                 param_dtype: jnp.dtype = jnp.float32) -> Decoder:
    """A randomly initialised decoder (tests, benchmarks, training from scratch)."""
    return Decoder(cfg, rngs=nnx.Rngs(params=seed), dtype=dtype, param_dtype=param_dtype)


class _ShapeOnlyKeys:
    """Stands in for `nnx.Rngs` where parameters are only traced for their shapes: one fixed
    key, no counter. Each draw from a real `nnx.Rngs` updates its count variable, which costs
    more under `eval_shape` than the rest of the build (`bench.load --phases`)."""

    def params(self) -> jax.Array:
        return jax.random.key(0)


def abstract_decoder(cfg: ModelConfig, *, dtype: jnp.dtype = jnp.float32,
                     param_dtype: jnp.dtype = jnp.float32) -> Decoder:
    """The decoder with shape-only parameters (no memory), for loading and sharding."""
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=_ShapeOnlyKeys(), dtype=dtype,
                                          param_dtype=param_dtype))


__all__ = ["Decoder", "KVCache", "PagedKVCache", "abstract_decoder", "init_decoder"]
