"""The jitted train step: wiring against plain jax.grad, exact gradient accumulation, an 8-device
FSDP x TP sharded step equal to the unsharded one, donation, `wrt` filters and float32 masters;
`setup_train_step` equal to a hand-built step, and its state, batches and forward passes placed
on an 8-device mesh by logical axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nonstop.models.sharding import make_mesh
from nonstop.train.optim import OptimizerConfig, build_optimizer, build_schedule
from nonstop.train.state import TrainState, state_shardings
from nonstop.train.step import make_train_step, setup_train_step

V, D, F = 37, 14, 20  # D divisible by fsdp=2, F by tp=4; V prime
B, T = 8, 11


class TinyLM(nnx.Module):
    """Embedding -> one gelu MLP block with a residual -> unembedding, sharded FSDP x TP."""

    def __init__(self, *, seed: int = 0, dtype: jnp.dtype = jnp.float32):
        # NumPy initialisation: eager jax.random would compile a kernel per shape in every test.
        rs = np.random.RandomState(seed)

        def param(shape: tuple[int, ...], names: tuple[str | None, ...]) -> nnx.Param:
            value = jnp.asarray(rs.normal(size=shape) / np.sqrt(shape[0]), dtype)
            return nnx.Param(value, sharding_names=names, eager_sharding=False)

        self.embed = param((V, D), (None, "fsdp"))
        self.mlp_in = param((D, F), ("fsdp", "tp"))
        self.mlp_bias = nnx.Param(
            jnp.zeros((F,), dtype), sharding_names=("tp",), eager_sharding=False
        )
        self.mlp_out = param((F, D), ("tp", "fsdp"))
        self.unembed = param((D, V), ("fsdp", None))

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        x_BTD = self.embed[...][tokens_BT].astype(jnp.float32)
        h_BTF = jax.nn.gelu(x_BTD @ self.mlp_in[...] + self.mlp_bias[...])
        x_BTD = x_BTD + h_BTF @ self.mlp_out[...]
        return x_BTD @ self.unembed[...]


def lm_loss(model: TinyLM, batch: dict, rng: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
    """Masked next-token cross-entropy as a (sum, count) pair, with the mean logit as aux."""
    del rng
    logits_BTV = model(batch["tokens"])
    nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["targets"])
    mask_BT = batch["loss_mask"].astype(jnp.float32)
    return (nll_BT * mask_BT).sum(), mask_BT.sum(), {"mean_logit": logits_BTV.mean()}


def make_batch(seed: int) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(seed)
    tokens = rs.randint(0, V, size=(B, T)).astype(np.int32)
    # Very uneven loss-token counts per row, so per-micro-batch means differ from the batch mean.
    lengths = np.array([1, 11, 2, 9, 3, 10, 1, 7])
    mask = np.arange(T)[None, :] < lengths[:, None]
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "loss_mask": mask}


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_trees_close(a, b, atol: float) -> None:
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


ADAMW = OptimizerConfig(
    learning_rate=1e-2, weight_decay=0.1, warmup_steps=2, total_steps=10, max_grad_norm=0.5
)


def fresh_state(cfg: OptimizerConfig = ADAMW, **kwargs) -> TrainState:
    return TrainState.create(TinyLM(), build_optimizer(cfg), rng=jax.random.key(1), **kwargs)


@pytest.fixture(scope="module")
def adamw_steps():
    opt = build_optimizer(ADAMW)
    sched = build_schedule(ADAMW)
    return {
        k: make_train_step(lm_loss, opt, learning_rate=sched, grad_accum_steps=k) for k in (1, 4)
    }


def test_one_sgd_step_matches_plain_jax_grad():
    cfg = OptimizerConfig(
        name="sgd", learning_rate=0.3, b1=0.0, schedule="constant", max_grad_norm=None
    )
    state = fresh_state(cfg)
    batch = make_batch(0)
    model = TinyLM()

    def mean_loss(m):
        num, den, _ = lm_loss(m, batch, jax.random.key(0))
        return num / den

    ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(mean_loss))(model)
    expected = jax.tree.map(lambda p, g: p - 0.3 * g, nnx.state(model, nnx.Param), ref_grads)

    step = make_train_step(lm_loss, build_optimizer(cfg), learning_rate=build_schedule(cfg))
    new_state, metrics = step(state, batch)

    assert_trees_close(new_state.params, expected, atol=1e-6)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], optax.global_norm(ref_grads), rtol=1e-5)
    assert float(metrics["tokens"]) == batch["loss_mask"].sum()
    np.testing.assert_allclose(metrics["learning_rate"], 0.3)
    assert int(new_state.step) == 1


def test_grad_accumulation_equals_one_big_batch(adamw_steps):
    batch = make_batch(1)
    big, big_metrics = adamw_steps[1](fresh_state(), batch)
    accum, accum_metrics = adamw_steps[4](fresh_state(), batch)

    assert_trees_close(accum.params, big.params, atol=1e-5)
    assert_trees_close(accum.opt_state, big.opt_state, atol=1e-5)
    for name in ("loss", "grad_norm", "tokens", "learning_rate"):
        np.testing.assert_allclose(accum_metrics[name], big_metrics[name], rtol=1e-5)

    # The test can fail: averaging per-micro-batch means (the naive scheme) gives another loss.
    micro_mean = nnx.jit(lambda m, b: (lambda n, d, _: n / d)(*lm_loss(m, b, None)))
    model = fresh_state().model()
    micro_means = [micro_mean(model, {k: v[j::4] for k, v in batch.items()}) for j in range(4)]
    assert abs(float(np.mean(micro_means)) - float(big_metrics["loss"])) > 1e-2


def test_learning_rate_follows_schedule_and_step_compiles_once(adamw_steps):
    step = adamw_steps[1]
    state = fresh_state()
    rates = []
    for i in range(3):
        state, metrics = step(state, make_batch(10 + i))
        rates.append(float(metrics["learning_rate"]))
    # Warmup of 2 steps from 0 to 1e-2, then cosine over the remaining 8.
    expected = [0.0, 5e-3, 1e-2]
    np.testing.assert_allclose(rates, expected, atol=1e-8)
    assert int(state.step) == 3
    assert step._cache_size() == 1


def test_step_donates_the_input_state(adamw_steps):
    state = fresh_state()
    old_leaves = jax.tree.leaves(state.params)
    new_state, _ = adamw_steps[1](state, make_batch(2))
    assert all(x.is_deleted() for x in old_leaves)
    assert not any(x.is_deleted() for x in jax.tree.leaves(new_state.params))


def test_wrt_filter_trains_only_selected_params():
    cfg = OptimizerConfig(learning_rate=1e-2, schedule="constant")
    model = TinyLM()
    before = nnx.to_pure_dict(nnx.state(model))
    state = TrainState.create(
        model,
        build_optimizer(cfg),
        rng=jax.random.key(0),
        wrt=nnx.All(nnx.Param, nnx.PathContains("mlp_out")),
    )
    assert set(nnx.to_pure_dict(state.params)) == {"mlp_out"}
    step = make_train_step(lm_loss, build_optimizer(cfg), donate=False)
    new_state, _ = step(state, make_batch(3))
    after = nnx.to_pure_dict(nnx.state(new_state.model()))
    for name in ("embed", "mlp_in", "mlp_bias", "unembed"):
        np.testing.assert_array_equal(after[name], before[name])
    assert np.abs(after["mlp_out"] - before["mlp_out"]).max() > 1e-4


def test_bf16_model_keeps_float32_master_params_and_moments():
    state = TrainState.create(
        TinyLM(dtype=jnp.bfloat16), build_optimizer(ADAMW), rng=jax.random.key(0)
    )
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    float_moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert float_moments and {x.dtype for x in float_moments} == {jnp.dtype(jnp.float32)}


def test_sharded_step_on_8_devices_equals_unsharded(adamw_steps):
    if len(jax.devices()) < 8:
        pytest.skip(
            "needs 8 devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8 "
            "before jax initialises (tests/conftest.py does)"
        )
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 2, 4), ("data", "fsdp", "tp"))
    opt = build_optimizer(ADAMW)
    shardings = state_shardings(fresh_state(), mesh)
    batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    sharded_step = make_train_step(
        lm_loss,
        opt,
        learning_rate=build_schedule(ADAMW),
        grad_accum_steps=4,
        state_shardings=shardings,
        batch_sharding=batch_sharding,
    )
    ref_step = adamw_steps[4]

    sharded = jax.device_put(fresh_state(), shardings)
    ref = fresh_state()
    for i in range(3):
        batch = make_batch(20 + i)
        sharded, sharded_metrics = sharded_step(sharded, jax.device_put(batch, batch_sharding))
        ref, ref_metrics = ref_step(ref, batch)

    assert_trees_close(sharded.params, ref.params, atol=1e-5)
    assert_trees_close(sharded.opt_state, ref.opt_state, atol=1e-5)
    np.testing.assert_allclose(sharded_metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    # The layout really is FSDP x TP, for parameters and for the Adam moments that mirror them.
    assert sharded.params["mlp_in"][...].sharding.spec == PartitionSpec("fsdp", "tp")
    assert len(sharded.params["mlp_in"][...].addressable_shards) == 8
    mu = sharded.opt_state[1][0].mu
    assert mu["mlp_out"][...].sharding.spec == PartitionSpec("tp", "fsdp")
    assert sharded.opt_state[1][0].count.sharding.spec == PartitionSpec()


# The logical axes the trainers' models carry; on the (1, 2, 4) mesh they give the same layout as
# TinyLM's sharding names (V=37 is not divisible by tp=4, so the vocabulary stays replicated).
LOGICAL_AXES = {
    "embed": ("vocab", "embed"),
    "mlp_in": ("embed", "mlp"),
    "mlp_bias": ("mlp",),
    "mlp_out": ("mlp", "embed"),
    "unembed": ("embed", "vocab"),
}


def logical_tiny_lm() -> TinyLM:
    model = TinyLM()
    for name, axes in LOGICAL_AXES.items():
        setattr(model, name, nnx.Param(getattr(model, name)[...], logical_axes=axes))
    return model


def test_setup_train_step_equals_a_hand_built_step(adamw_steps):
    setup = setup_train_step(TinyLM(), lm_loss, ADAMW, seed=1, grad_accum_steps=4)
    assert setup.batch_sharding is None
    state, ref = setup.state, fresh_state()
    first_params = jax.tree.leaves(state.params)
    for i in range(2):
        batch = make_batch(30 + i)
        assert setup.put(batch) is batch  # no mesh: batches stay where they are
        state, metrics = setup.step(state, batch)
        ref, ref_metrics = adamw_steps[4](ref, batch)

    # Same optimizer, schedule, RNG and accumulation: bit for bit the hand-built step.
    got = (state.params, state.opt_state, state.step, jax.random.key_data(state.rng), metrics)
    want = (ref.params, ref.opt_state, ref.step, jax.random.key_data(ref.rng), ref_metrics)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(leaves(got), leaves(want), strict=True):
        np.testing.assert_array_equal(x, y)
    assert all(x.is_deleted() for x in first_params)  # donated


def test_setup_train_step_trains_only_wrt_and_checks_its_arguments():
    cfg = OptimizerConfig(learning_rate=1e-2, schedule="constant")
    only_out = nnx.All(nnx.Param, nnx.PathContains("mlp_out"))
    setup = setup_train_step(TinyLM(), lm_loss, cfg, seed=0, wrt=only_out)
    assert set(nnx.to_pure_dict(setup.state.params)) == {"mlp_out"}

    with pytest.raises(ValueError, match="no seed"):
        setup_train_step(TinyLM(), lm_loss, cfg)
    with pytest.raises(ValueError, match="given a TrainState"):
        setup_train_step(fresh_state(cfg), lm_loss, cfg, seed=0)


def test_setup_train_step_places_state_batches_and_forward_passes_on_8_devices(adamw_steps):
    if len(jax.devices()) < 8:
        pytest.skip(
            "needs 8 devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8 "
            "before jax initialises (tests/conftest.py does)"
        )
    mesh = make_mesh(data=1, fsdp=2, tp=4, devices=jax.devices()[:8])
    setup = setup_train_step(
        logical_tiny_lm(), lm_loss, ADAMW, seed=1, grad_accum_steps=4, mesh=mesh
    )
    rows = PartitionSpec(("data", "fsdp"))
    assert setup.batch_sharding == NamedSharding(mesh, rows)
    params = setup.state.params
    assert params["mlp_in"][...].sharding.spec == PartitionSpec("fsdp", "tp")
    assert len(params["mlp_in"][...].addressable_shards) == 8
    assert params["embed"][...].sharding.spec == PartitionSpec(None, "fsdp")
    assert setup.state.opt_state[1][0].mu["mlp_out"][...].sharding.spec == PartitionSpec(
        "tp", "fsdp"
    )

    # Each leaf is split on its own leading axis (the vision trainer's image slots).
    placed = setup.put({**make_batch(40), "images": np.zeros((2, 3), np.float32)})
    assert placed["tokens"].sharding.spec == rows
    assert placed["images"].sharding.spec == rows and placed["images"].shape == (2, 3)

    graphdef = setup.state.graphdef
    logits = setup.jit_rows(lambda p, f, b: nnx.merge(graphdef, p, f)(b["tokens"]))
    out = logits(setup.state.params, setup.state.frozen, placed)
    assert out.sharding.spec == rows
    np.testing.assert_allclose(out, fresh_state().model()(make_batch(40)["tokens"]), atol=1e-5)

    state, ref = setup.state, fresh_state()
    for i in range(3):
        batch = make_batch(20 + i)
        state, metrics = setup.step(state, setup.put(batch))
        ref, ref_metrics = adamw_steps[4](ref, batch)
    assert_trees_close(state.params, ref.params, atol=1e-5)
    assert_trees_close(state.opt_state, ref.opt_state, atol=1e-5)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    assert state.params["mlp_out"][...].sharding.spec == PartitionSpec("tp", "fsdp")
