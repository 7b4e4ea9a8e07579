"""Optimizer configs, schedules and update rules against values worked out by hand."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nonstop.train.optim import OptimizerConfig, build_optimizer, build_schedule


def schedule_values(steps: list[int], **kwargs) -> list[float]:
    cfg = OptimizerConfig(
        learning_rate=1.0, warmup_steps=4, total_steps=12, min_lr_ratio=0.1, **kwargs
    )
    schedule = build_schedule(cfg)
    return [float(schedule(s)) for s in steps]


def test_cosine_schedule_warms_up_then_decays_to_the_floor():
    got = schedule_values([0, 2, 4, 6, 8, 12, 20], schedule="cosine")
    # Warmup 0 -> 1 over 4 steps; cosine over 8 steps from 1 to 0.1: 0.1 + 0.45 (1 + cos(pi p)).
    want = [0.0, 0.5, 1.0, 0.1 + 0.45 * (1 + math.cos(math.pi / 4)), 0.55, 0.1, 0.1]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_linear_and_constant_schedules():
    np.testing.assert_allclose(
        schedule_values([2, 4, 6, 12, 20], schedule="linear"),
        [0.5, 1.0, 0.775, 0.1, 0.1],
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        schedule_values([1, 4, 11], schedule="constant"), [0.25, 1.0, 1.0], rtol=1e-6
    )
    no_warmup = build_schedule(
        OptimizerConfig(learning_rate=0.3, schedule="linear", total_steps=10)
    )
    np.testing.assert_allclose([float(no_warmup(s)) for s in (0, 5)], [0.3, 0.15], rtol=1e-6)


def test_adamw_first_step_decays_only_matrices():
    cfg = OptimizerConfig(
        learning_rate=0.1, weight_decay=0.01, schedule="constant", eps=1e-12, max_grad_norm=None
    )
    params = {"w": jnp.array([[1.0, -2.0]]), "b": jnp.array([3.0])}
    grads = {"w": jnp.array([[0.5, -0.1]]), "b": jnp.array([2.0])}
    opt = build_optimizer(cfg)
    updates, _ = opt.update(grads, opt.init(params), params)
    new = optax.apply_updates(params, updates)
    # Bias-corrected first Adam step is g / |g| = sign(g); decoupled decay lr * wd * p on w only.
    np.testing.assert_allclose(
        new["w"], [[1 - 0.1 * (1 + 0.01), -2 - 0.1 * (-1 - 0.02)]], rtol=1e-6
    )
    np.testing.assert_allclose(new["b"], [3 - 0.1], rtol=1e-6)


def test_clipping_scales_to_max_global_norm():
    cfg = OptimizerConfig(
        name="sgd", learning_rate=0.5, b1=0.0, schedule="constant", max_grad_norm=1.0
    )
    params = {"a": jnp.zeros((2,)), "b": jnp.zeros(())}
    grads = {"a": jnp.array([3.0, 0.0]), "b": jnp.array(4.0)}  # global norm 5
    opt = build_optimizer(cfg)
    updates, _ = opt.update(grads, opt.init(params), params)
    np.testing.assert_allclose(updates["a"], [-0.5 * 3 / 5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(updates["b"], -0.5 * 4 / 5, rtol=1e-6)
    small = {"a": jnp.array([0.3, 0.0]), "b": jnp.array(0.4)}  # norm 0.5: left alone
    updates, _ = opt.update(small, opt.init(params), params)
    np.testing.assert_allclose(updates["a"], [-0.15, 0.0], rtol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor"])
def test_every_optimizer_minimises_a_quadratic(name):
    cfg = OptimizerConfig(
        name=name,
        learning_rate=0.05,
        schedule="constant",
        total_steps=200,
        max_grad_norm=None,
        b1=0.9 if name != "sgd" else 0.5,
    )
    target = jnp.arange(15.0).reshape(3, 5) / 7
    opt = build_optimizer(cfg)

    @jax.jit
    def run(params):
        def body(_, carry):
            p, s = carry
            g = jax.grad(lambda x: jnp.sum((x["m"] - target) ** 2))(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        return jax.lax.fori_loop(0, 200, body, (params, opt.init(params)))[0]

    start = {"m": jnp.zeros((3, 5))}
    final = run(start)
    assert float(jnp.abs(final["m"] - target).max()) < 0.1 * float(jnp.abs(target).max())
    assert final["m"].dtype == jnp.float32


@pytest.mark.parametrize(
    "field, value, hint",
    [
        ("name", "lion", "one of"),
        ("schedule", "step", "one of"),
        ("learning_rate", 0.0, "> 0"),
        ("b2", 1.0, "[0, 1)"),
        ("warmup_steps", 20, "total_steps=10"),
        ("min_lr_ratio", 1.5, "[0, 1]"),
        ("max_grad_norm", -1.0, "None"),
        ("weight_decay_mask", "norms", "one of"),
    ],
)
def test_config_errors_name_field_value_and_valid_range(field, value, hint):
    with pytest.raises(ValueError) as err:
        OptimizerConfig(total_steps=10, **{field: value})
    message = str(err.value)
    assert f"{field}={value!r}" in message and hint in message
