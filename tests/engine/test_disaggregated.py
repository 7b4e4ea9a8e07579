"""Disaggregated placement on 8 forced CPU devices: the engine on 4 (data=2 x tp=2), the trainer on
the other 4 (fsdp=2 x tp=2), both working at once; weights handed over by resharding.

Checked: the trainer's steps equal the same steps on one device; the engine keeps completing
requests while the trainer steps; after `update_weights` the engine's weights are exactly the
trainer's, live only on the engine's devices, cause no recompilation, and generate what a
colocated engine with the trained weights generates.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nonstop.engine import Engine, EngineConfig, SamplingParams
from nonstop.engine.placement import (
    MeshShape,
    PlacementConfig,
    devices_of,
    max_abs_difference,
    place,
)
from nonstop.models import ModelConfig, init_decoder
from nonstop.sft.preference import sft_loss_fn
from nonstop.train import (
    OptimizerConfig,
    TrainBatch,
    TrainState,
    build_optimizer,
    make_train_step,
    state_shardings,
)
from nonstop.train.distributed import logical_partition_specs

CFG = ModelConfig.tiny("qwen3", vocab_size=31)
STEPS = 3
PROMPT = [1, 5, 6, 7, 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=7)
DISAGGREGATED = PlacementConfig(mode="disaggregated", engine=MeshShape(data=2, tp=2),
                                trainer=MeshShape(fsdp=2, tp=2))


def fixed_batch() -> TrainBatch:
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, CFG.vocab_size, size=(4, 13)).astype(np.int32)
    return TrainBatch(tokens=tokens, positions=np.tile(np.arange(13, dtype=np.int32), (4, 1)),
                      segment_ids=np.ones_like(tokens), loss_mask=np.ones(tokens.shape, bool))


def new_state() -> TrainState:
    # SGD: a sharded step's float32 reductions differ from one device's in the last bits, and
    # Adam's first update (about lr * sign(g)) would amplify that for near-zero gradients.
    optimizer = build_optimizer(OptimizerConfig(name="sgd", learning_rate=0.5,
                                                schedule="constant"))
    return TrainState.create(init_decoder(CFG, seed=0), optimizer, rng=jax.random.key(0))


@pytest.fixture(scope="module")
def run():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 CPU devices)")
    placement = place(DISAGGREGATED)
    optimizer = build_optimizer(OptimizerConfig(name="sgd", learning_rate=0.5,
                                                schedule="constant"))
    loss_fn = sft_loss_fn()

    # One device, for reference.
    reference_step = make_train_step(loss_fn, optimizer)
    reference = new_state()
    for _ in range(STEPS):
        reference, _ = reference_step(reference, fixed_batch())

    engine = Engine(init_decoder(CFG, seed=0), EngineConfig(max_slots=4, max_len=32, prefill_chunks=(8,)), mesh=placement.engine_mesh)
    engine.start()
    mesh = placement.trainer_mesh
    state = new_state()
    shardings = state_shardings(state, mesh, partition_specs=logical_partition_specs(mesh))
    state = jax.device_put(state, shardings)
    batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    step = make_train_step(loss_fn, optimizer, state_shardings=shardings,
                           batch_sharding=batch_sharding)

    # The engine samples continuously in the background while the trainer steps.
    done, stop = [], threading.Event()

    def sample_forever() -> None:
        seed = 0
        while not stop.is_set():
            params = SamplingParams(temperature=1.0, max_tokens=12, seed=seed)
            done.append(engine.generate_sync(PROMPT, params, timeout=60))
            seed += 1

    sampler = threading.Thread(target=sample_forever, daemon=True)
    sampler.start()
    try:
        while not done:  # the engine is compiled and serving before training starts
            sampler.join(0.05)
        before, losses = len(done), []
        for _ in range(STEPS):
            state, metrics = step(state, jax.device_put(fixed_batch(), batch_sharding))
            losses.append(float(metrics["loss"]))
        during = len(done) - before
    finally:
        stop.set()
        sampler.join(60)
    trained = nnx.state(state.model())
    traces_before = dict(engine.stats().traces)
    engine.update_weights(trained, version=1)
    after = engine.generate_sync(PROMPT, GREEDY, timeout=60)
    engine_weights = engine._scheduler.state  # what the scheduler thread now decodes with
    traces_after = dict(engine.stats().traces)
    engine.stop()
    return dict(placement=placement, reference=reference, state=state, trained=trained,
                losses=losses, during=during, after=after, engine_weights=engine_weights,
                traces=(traces_before, traces_after))


def test_placement_splits_devices():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 CPU devices)")
    split = place(DISAGGREGATED)
    assert split.engine_devices == frozenset(jax.devices()[:4])
    assert split.trainer_devices == frozenset(jax.devices()[4:8])
    assert dict(split.engine_mesh.shape) == {"data": 2, "fsdp": 1, "tp": 2}
    shared = place(PlacementConfig(engine=MeshShape(tp=2), trainer=MeshShape(fsdp=2)))
    assert shared.mode == "colocated" and shared.engine_devices == shared.trainer_devices
    with pytest.raises(ValueError, match="needs 12 devices"):
        place(PlacementConfig(mode="disaggregated", engine=MeshShape(tp=4),
                              trainer=MeshShape(fsdp=8)))
    with pytest.raises(ValueError, match="same number"):
        PlacementConfig(engine=MeshShape(tp=2), trainer=MeshShape(fsdp=4))


def test_trainer_on_its_sub_mesh_matches_one_device(run):
    assert run["losses"][-1] < run["losses"][0]
    assert max_abs_difference(run["state"].params, run["reference"].params) <= 1e-5
    assert devices_of(run["state"].params) == run["placement"].trainer_devices


def test_engine_serves_while_trainer_steps(run):
    assert run["during"] >= 1
    assert run["placement"].engine_devices.isdisjoint(run["placement"].trainer_devices)


def test_handed_over_weights_equal_the_trainers(run):
    assert max_abs_difference(run["engine_weights"], run["trained"]) == 0.0
    assert devices_of(run["engine_weights"]) == run["placement"].engine_devices
    before, after = run["traces"]
    assert {k: v for k, v in after.items() if not k.startswith("sample")} == \
        {k: v for k, v in before.items() if not k.startswith("sample")}  # no recompilation
    assert set(run["after"].policy_versions) == {1}


def test_engine_generates_like_a_colocated_engine_with_the_trained_weights(run):
    colocated = init_decoder(CFG, seed=0)
    host = jax.device_get(run["trained"])
    nnx.update(colocated, jax.tree.map(lambda x: jax.device_put(jnp.asarray(x),
                                                                  jax.devices()[0]), host))
    with Engine(colocated, EngineConfig(max_slots=4, max_len=32, prefill_chunks=(8,))) as engine:
        want = engine.generate_sync(PROMPT, GREEDY, timeout=60)
    got = run["after"]
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


def test_an_engine_on_its_sub_mesh_running_several_steps_a_call_generates_the_same(run):
    engine = Engine(init_decoder(CFG, seed=0), EngineConfig(max_slots=4, max_len=32, prefill_chunks=(8,), decode_steps_per_call=3), mesh=run["placement"].engine_mesh)
    with engine:
        traces = dict(engine.stats().traces)
        engine.update_weights(run["trained"], version=1)
        got = engine.generate_sync(PROMPT, GREEDY, timeout=60)
        assert engine.stats().traces == traces
    want = run["after"]
    assert got.tokens == want.tokens and got.policy_versions == want.policy_versions
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


def test_an_engine_on_its_sub_mesh_parks_evicted_sessions_bit_exactly(run):
    """Parking on a mesh: the parking cache is sharded like the cache (3 rows: not a multiple
    of the data axis); an evicted session's turn equals the same turn without the eviction."""
    engine = Engine(init_decoder(CFG, seed=0), EngineConfig(max_slots=2, max_len=32, prefill_chunks=(8,), parked_slots=3), mesh=run["placement"].engine_mesh)
    params = SamplingParams(temperature=0.0, max_tokens=4)

    def two_turns(others: int):
        with engine.session() as session:
            first = engine.generate_sync(PROMPT, params, session=session, timeout=60)
            rivals = [engine.session() for _ in range(others)]
            for i, rival in enumerate(rivals):
                engine.generate_sync([3 + i, 4, 5], params, session=rival, timeout=60)
            second = engine.generate_sync(PROMPT + list(first.tokens) + [7, 8], params,
                                          session=session, timeout=60)
            for rival in rivals:
                rival.close()
        return second

    with engine:
        traces = dict(engine.stats().traces)
        kept = two_turns(0)
        parked = two_turns(2)
        stats = engine.stats()
        assert stats.parked >= 1 and stats.unparked == 1 and engine.stats().traces == traces
    assert parked.num_cached == kept.num_cached == len(PROMPT) + 3
    assert parked.tokens == kept.tokens and parked.logprobs == kept.logprobs
