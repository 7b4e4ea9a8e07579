"""Decoder parity with transformers for every family, KV-cache decoding, packing, sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from nonstop.models import (
    Decoder,
    KVCache,
    abstract_decoder,
    load_pretrained,
    make_mesh,
    save_pretrained,
    shard_model,
)
from nonstop.models.presets import tiny_config
from tests.models.hf_fixtures import FAMILIES, build_hf_model, hf_logits

ATOL_HF = 1e-4
ATOL_CACHE = 1e-5


@pytest.fixture(scope="module", params=FAMILIES)
def family_models(request, tmp_path_factory):
    family = request.param
    directory = tmp_path_factory.mktemp(family)
    hf = build_hf_model(family, directory, seed=3)
    ours = load_pretrained(directory)
    return family, hf, ours, directory


def _tokens(shape, vocab=257, seed=0) -> np.ndarray:
    return np.random.RandomState(seed).randint(3, vocab, shape).astype(np.int32)


def test_logits_match_transformers(family_models):
    family, hf, ours, _ = family_models
    tokens = _tokens((2, 13))  # 13 > the Gemma 2/3 sliding window of 4
    ref = hf_logits(hf, tokens)
    logits, _ = ours(jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits), ref, atol=ATOL_HF, rtol=0)


def test_padded_batch_matches_transformers(family_models):
    family, hf, ours, _ = family_models
    tokens = _tokens((2, 13), seed=1)
    mask = np.ones((2, 13), np.int32)
    mask[1, 7:] = 0  # right padding
    tokens[1, 7:] = 0
    ref = hf_logits(hf, tokens, mask)
    logits, _ = ours(jnp.asarray(tokens), segment_ids=jnp.asarray(mask))
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[valid], ref[valid], atol=ATOL_HF, rtol=0)


def test_save_round_trip_loads_in_transformers(family_models, tmp_path):
    family, hf, ours, _ = family_models
    save_pretrained(ours, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    tokens = _tokens((1, 9), seed=2)
    np.testing.assert_allclose(hf_logits(reloaded.eval(), tokens), hf_logits(hf, tokens),
                               atol=1e-6, rtol=0)


def test_sharded_checkpoint_round_trip(family_models, tmp_path):
    family, _, ours, _ = family_models
    save_pretrained(ours, tmp_path, max_shard_bytes=20_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    again = load_pretrained(tmp_path)
    tokens = jnp.asarray(_tokens((1, 5)))
    np.testing.assert_array_equal(np.asarray(again(tokens)[0]), np.asarray(ours(tokens)[0]))


def test_prefill_then_decode_equals_full_forward(family_models):
    """Chunked prefill into one slot, then token-by-token decode over all slots."""
    family, _, ours, _ = family_models
    tokens = _tokens((1, 12), seed=4)
    full, _ = ours(jnp.asarray(tokens))
    cache = KVCache.create(ours.cfg, num_slots=3, max_len=16)
    slot = jnp.array([1])
    # Two prefill chunks (4 + 3 tokens) into slot 1.
    chunk_logits = []
    for start, stop in ((0, 4), (4, 7)):
        pos = jnp.arange(start, stop)[None]
        out, cache = ours(jnp.asarray(tokens[:, start:stop]), pos, cache=cache, slots=slot)
        chunk_logits.append(out)
    prefill = jnp.concatenate(chunk_logits, axis=1)
    np.testing.assert_allclose(np.asarray(prefill[0]), np.asarray(full[0, :7]), atol=ATOL_CACHE)
    # Decode the rest one token at a time with all three slots in the batch; the other slots are
    # parked at position max_len, where they must write nothing.
    parked = cache.max_len
    for t in range(7, 12):
        step_tokens = jnp.array([[0], [tokens[0, t]], [0]], jnp.int32)
        step_pos = jnp.array([[parked], [t], [parked]], jnp.int32)
        out, cache = ours(step_tokens, step_pos, cache=cache)
        np.testing.assert_allclose(np.asarray(out[1, 0]), np.asarray(full[0, t]), atol=ATOL_CACHE)
    for layer_keys in cache.keys:
        assert not np.any(np.asarray(layer_keys[0])), "a parked slot must not be written"


def test_packed_row_equals_sequences_alone(family_models):
    family, _, ours, _ = family_models
    lengths = (5, 4, 3)
    seqs = [_tokens((1, n), seed=10 + i) for i, n in enumerate(lengths)]
    T = 14
    tokens = np.zeros((1, T), np.int32)
    positions = np.zeros((1, T), np.int32)
    segments = np.zeros((1, T), np.int32)
    start = 0
    for i, s in enumerate(seqs):
        n = s.shape[1]
        tokens[0, start:start + n] = s[0]
        positions[0, start:start + n] = np.arange(n)
        segments[0, start:start + n] = i + 1
        start += n
    packed, _ = ours(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))
    start = 0
    for s in seqs:
        n = s.shape[1]
        alone, _ = ours(jnp.asarray(s))
        # float32 rounding only (the packed row's matmuls run over 14 positions, these over
        # n); a segment attending to another would change its logits far beyond this.
        np.testing.assert_allclose(np.asarray(packed[0, start:start + n]), np.asarray(alone[0]),
                                   atol=ATOL_CACHE, rtol=1e-5)
        start += n


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_sharded_forward_equals_unsharded(family, tmp_path):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    build_hf_model(family, tmp_path, seed=5)
    reference = load_pretrained(tmp_path)
    mesh = make_mesh(fsdp=2, tp=4)
    sharded = load_pretrained(tmp_path, mesh=mesh)
    q = sharded.layers[0].attn.q_proj[...]
    assert len(q.sharding.device_set) == 8 and not q.sharding.is_fully_replicated
    tokens = jnp.asarray(_tokens((2, 9), seed=6))

    @nnx.jit
    def forward(model, tokens):
        return model(tokens)[0]

    expected = forward(reference, tokens)
    got = forward(sharded, tokens)
    # fsdp splits each contraction over D into two partial sums: float32 addition order changes,
    # so the bound is relative (logits here reach ~6; observed worst case 2.7e-6 relative).
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    # shard_model re-places an existing model the same way.
    moved = shard_model(reference, mesh)
    for name in ("q_proj", "o_proj"):
        a = getattr(moved.layers[0].attn, name)[...]
        b = getattr(sharded.layers[0].attn, name)[...]
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"])
def test_abstract_decoder_has_the_structure_of_a_real_build(family):
    """The shape-only build (one fixed key, no rng counter) gives the graph, parameter paths,
    shapes, dtypes and logical axes of a decoder built with `nnx.Rngs`."""
    cfg = tiny_config(family)
    real = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(params=0), dtype=jnp.bfloat16,
                                          param_dtype=jnp.float32))
    graph, state = nnx.split(abstract_decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32))
    real_graph, real_state = nnx.split(real)
    assert graph == real_graph

    def described(s):
        return {tuple(p): (v.get_value().shape, v.get_value().dtype, v.logical_axes)
                for p, v in nnx.to_flat_state(s)}

    assert described(state) == described(real_state)
