"""LoRA and QLoRA: identity at init, only adapters train, merging, quantization error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nonstop.models import ModelConfig, init_decoder, load_pretrained, save_pretrained
from nonstop.models.lora import (
    LoRAConfig,
    LoRAWeight,
    apply_lora,
    dense,
    has_lora,
    merge_lora,
)
from nonstop.models.quantize import QuantConfig, QuantizedWeight, quantization_error, quantize_model
from nonstop.train import TrainState, make_train_step

CFG = ModelConfig.tiny("qwen3")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENS = jnp.asarray(np.random.RandomState(0).randint(3, 257, (4, 12)), jnp.int32)


def _lm_loss(model, batch, rng):
    logits, _ = model(batch)
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)[..., 0]
    return nll.sum(), jnp.asarray(nll.size, jnp.float32), {}


def _train(model, steps, wrt=nnx.LoRAParam, lr=1e-2):
    optimizer = optax.adam(lr)
    state = TrainState.create(model, optimizer, rng=jax.random.key(0), wrt=wrt)
    step = make_train_step(_lm_loss, optimizer)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, TOKENS)
        losses.append(float(metrics["loss"]))
    return state.model(), losses


def test_zero_initialised_adapters_leave_outputs_unchanged():
    base = init_decoder(CFG, seed=1)
    expected, _ = base(TOKENS)
    adapted = apply_lora(init_decoder(CFG, seed=1), LoRAConfig(rank=4, targets=ALL))
    assert has_lora(adapted)
    got, _ = adapted(TOKENS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_only_adapters_change_and_merge_gives_adapted_logits(tmp_path):
    model = apply_lora(init_decoder(CFG, seed=1), LoRAConfig(rank=4, alpha=8.0))
    before = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
    trained, losses = _train(model, 5)
    assert losses[-1] < losses[0]
    after = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(trained))}
    changed = {p for p in before if not np.array_equal(before[p], after[p])}
    assert changed and all(p[-1] in ("lora_a", "lora_b") for p in changed)
    assert any(p[-1] == "lora_b" for p in changed)
    adapted_logits, _ = trained(TOKENS)
    merged = merge_lora(trained)
    assert not has_lora(merged)
    merged_logits, _ = merged(TOKENS)
    np.testing.assert_allclose(np.asarray(merged_logits), np.asarray(adapted_logits), atol=1e-5)
    save_pretrained(merged, tmp_path)
    exported, _ = load_pretrained(tmp_path)(TOKENS)
    np.testing.assert_allclose(np.asarray(exported), np.asarray(adapted_logits), atol=1e-5)


def test_adapter_forward_is_base_plus_scaled_low_rank_update():
    model = apply_lora(init_decoder(CFG, seed=2), LoRAConfig(rank=3, alpha=6.0,
                                                            targets=("o_proj",)))
    w = model.layers[0].attn.o_proj
    assert isinstance(w, LoRAWeight) and w.lora_a[...].shape == (4, 8, 3)
    w.lora_b[...] = jax.random.normal(jax.random.key(1), w.lora_b[...].shape)
    x = jax.random.normal(jax.random.key(2), (2, 5, 4, 8))
    expected = jnp.einsum("btnh,nhd->btd", x, w.base[...] + 2.0 * jnp.einsum(
        "nhr,rd->nhd", w.lora_a[...], w.lora_b[...]))
    np.testing.assert_allclose(np.asarray(w(x)), np.asarray(expected), atol=1e-5)


@pytest.mark.parametrize("kind,bound", [("int8", 0.01), ("nf4", 0.12)])
def test_quantization_error_is_small(kind, bound):
    w = jax.random.normal(jax.random.key(0), (44, 4, 8)) * 0.02
    err = quantization_error(w, kind, n_in=1)
    assert 0 < err < bound


def test_nf4_codes_round_trip_exact_levels():
    # Weights that are exactly NF4 levels times a block scale come back exactly.
    levels = jnp.asarray(np.tile(np.linspace(0, 15, 16).astype(int), 8))
    from nonstop.models.quantize import NF4_LEVELS
    w = jnp.asarray(NF4_LEVELS)[levels].reshape(16, 8) * 0.5
    q = QuantizedWeight(w, kind="nf4", n_in=1)
    assert q.codes[...].dtype == jnp.uint8 and q.codes[...].shape == (2, 32)
    np.testing.assert_allclose(np.asarray(q.dequantize(jnp.float32)), np.asarray(w), atol=1e-7)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qlora_trains_and_keeps_base_quantized(kind):
    model = quantize_model(init_decoder(CFG, seed=3), QuantConfig(kind=kind))
    model = apply_lora(model, LoRAConfig(rank=4, targets=ALL))
    assert isinstance(model.layers[0].mlp.down_proj.base, QuantizedWeight)
    trainable = nnx.state(model, nnx.LoRAParam)
    assert all(p[-1] in ("lora_a", "lora_b") for p, _ in nnx.to_flat_state(trainable))
    trained, losses = _train(model, 6)
    assert losses[-1] < losses[0] - 0.05
    merged = merge_lora(trained)
    assert isinstance(merged.layers[0].mlp.down_proj, nnx.Param)


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"^LoRAConfig\.rank=0 is invalid; expected an int >= 1"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match=r"^LoRAConfig\.targets=\('wq',\) is invalid"):
        LoRAConfig(targets=("wq",))
    with pytest.raises(ValueError, match=r"^QuantConfig\.kind='fp3' is invalid; expected one of "
                                         r"'nf4', 'int8'"):
        QuantConfig(kind="fp3")


@pytest.mark.parametrize("kind", ["sft", "orpo"])
def test_lora_dropout_trains_through_the_supervised_losses(kind):
    """LoRA dropout inside a jitted step (the step reseeds a copy of the model: NNX refuses to
    mutate the traced one, TraceContextError): the adapters move, the same key gives the same
    update and another key another dropout mask, so another update."""
    from nonstop.sft.preference import ORPOConfig, orpo_loss_fn, sft_loss_fn
    from nonstop.train.batch import TrainBatch

    batch = TrainBatch(tokens=TOKENS,
                       positions=jnp.asarray(np.tile(np.arange(12), (4, 1)), jnp.int32),
                       segment_ids=jnp.asarray(np.repeat([[1] * 6 + [2] * 6], 4, 0), jnp.int32),
                       loss_mask=jnp.asarray(np.tile([0, 0, 1, 1, 1, 1] * 2, (4, 1)), bool))
    loss_fn = (sft_loss_fn(dropout=True) if kind == "sft"
               else orpo_loss_fn(ORPOConfig(), num_segments=2, dropout=True))
    model = apply_lora(init_decoder(CFG, seed=1), LoRAConfig(rank=4, alpha=8.0, dropout=0.5))
    before = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
    optimizer = optax.sgd(1e-1)
    step = make_train_step(loss_fn, optimizer, donate=False)

    def update(seed: int) -> list[np.ndarray]:
        state = TrainState.create(model, optimizer, rng=jax.random.key(seed), wrt=nnx.LoRAParam)
        new_state, _ = step(state, batch)
        after = jax.tree.leaves(nnx.state(new_state.model(), nnx.LoRAParam))
        return [np.asarray(a - b) for a, b in zip(after, before, strict=True)]

    first, again, other = update(0), update(0), update(1)
    assert max(float(np.abs(d).max()) for d in first) > 0
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.allclose(a, b) for a, b in zip(first, other, strict=True))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("x_shape", "w_shape", "n_in"), [
    ((2, 5, 8), (8, 3, 4), 1),    # q/k/v: inputs narrower than outputs
    ((2, 5, 12), (12, 6), 1),     # down/o: inputs wider than outputs
    ((2, 5, 3, 4), (3, 4, 7), 2),  # o_proj contracts heads and head_dim
])
def test_dense_gradients_equal_autodiff_of_tensordot(x_shape, w_shape, n_in, dtype):
    """`dense`'s hand-written weight gradient (the smaller operand transposed) and input
    gradient equal JAX's differentiation of the plain `tensordot`, in each dtype."""
    kx, kw, ky = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape, dtype)
    w = jax.random.normal(kw, w_shape, dtype)
    probe = jax.random.normal(ky, x_shape[:x.ndim - n_in] + w_shape[n_in:], jnp.float32)

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * probe)

    got = jax.grad(loss(lambda x, w: dense(x, w, n_in)), argnums=(0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: jnp.tensordot(x, w, axes=n_in)), argnums=(0, 1))(x, w)
    np.testing.assert_array_equal(dense(x, w, n_in), jnp.tensordot(x, w, axes=n_in))
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    for g, e in zip(got, want, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32),
                                   rtol=tol, atol=tol)
