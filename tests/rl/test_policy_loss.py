"""Clipped policy losses (PPO/GRPO/DAPO/GSPO/GSPO-token), off-policy corrections, KL term."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nonstop.rl import (
    KLConfig,
    OffPolicyConfig,
    PolicyLossConfig,
    RLAlgorithmConfig,
    aggregation_denominator,
    clipped_surrogate,
    importance_ratio,
    policy_loss,
)

NEG_INF = -np.inf
M = 2
# Row 0: sequence 1 = [prompt, gen, gen], sequence 2 = [prompt, gen]. Row 1: all masked.
SEGMENT_IDS = np.array([[1, 1, 1, 2, 2], [1, 1, 0, 0, 0]], np.int32)
LOSS_MASK = np.array([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0]], bool)
ZEROS = np.zeros((2, 5), np.float32)


def _row(t1: float, t2: float, t4: float, fill: float = 0.0) -> np.ndarray:
    """[2, 5] with values on the three loss tokens of row 0 and `fill` everywhere else."""
    out = np.full((2, 5), fill, np.float32)
    out[0, 1], out[0, 2], out[0, 4] = t1, t2, t4
    return out


# Current log-probs: log-ratio against zero behaviour log-probs is ln 1.25, ln 0.5, 0; -inf in
# prompt and padding positions (garbage that must not produce NaN).
LOGPROBS = _row(math.log(1.25), math.log(0.5), 0.0, fill=NEG_INF)
ADVANTAGES = _row(1.0, 2.0, -1.0)


def _loss(logprobs: jax.Array, config: PolicyLossConfig, **arrays: np.ndarray):  # noqa: ANN202
    inputs = {
        "advantages": ADVANTAGES,
        "behavior_logprobs": ZEROS,
        "loss_mask": LOSS_MASK,
        "segment_ids": SEGMENT_IDS,
    }
    inputs.update(arrays)
    return policy_loss(logprobs, config=config, max_segments=M, **inputs)


def _value_and_grad(config: PolicyLossConfig, logprobs: np.ndarray = LOGPROBS, **arrays):  # noqa: ANN003, ANN202
    def loss(lp: jax.Array) -> jax.Array:
        return _loss(lp, config, **arrays).terms.value()

    value, grad = jax.value_and_grad(loss)(jnp.asarray(logprobs))
    assert np.all(np.isfinite(np.asarray(grad))), "NaN/inf gradient"
    return float(value), np.asarray(grad)


DAPO_CLIP = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)


def test_token_loss_with_clip_higher_by_hand() -> None:
    value, grad = _value_and_grad(DAPO_CLIP)
    # t1: ratio 1.25, A=+1: clip(1.25, 0.8, 1.28) = 1.25, loss -1.25 (not clipped).
    # t2: ratio 0.5,  A=+2: max(-2*0.5, -2*0.8) = -1.0 (pessimistic: unclipped).
    # t4: ratio 1,    A=-1: 1.
    # token mean: (-1.25 - 1 + 1) / 3 = -0.416667; d/dlogp(-A r) = -A r: [-1.25, -1, 1] / 3.
    assert value == pytest.approx(-1.25 / 3, abs=1e-6)
    np.testing.assert_allclose(grad, _row(-1.25 / 3, -1 / 3, 1 / 3), atol=1e-6)


def test_symmetric_clip_clips_where_clip_higher_does_not() -> None:
    config = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2)
    value, grad = _value_and_grad(config)
    # t1: clip(1.25, 0.8, 1.2) = 1.2 -> loss -1.2 with zero gradient.
    # token mean: (-1.2 - 1 + 1) / 3 = -0.4.
    assert value == pytest.approx(-0.4, abs=1e-6)
    np.testing.assert_allclose(grad, _row(0.0, -1 / 3, 1 / 3), atol=1e-6)
    metrics = _loss(jnp.asarray(LOGPROBS), config).metrics
    assert float(metrics["clip_fraction"]) == pytest.approx(1 / 3)
    assert float(_loss(jnp.asarray(LOGPROBS), DAPO_CLIP).metrics["clip_fraction"]) == 0.0


@pytest.mark.parametrize(
    ("aggregation", "want"),
    [
        ("token_mean", -1.25 / 3),  # (-1.25 - 1 + 1) / 3 tokens
        ("seq_mean_token_mean", -0.0625),  # ((-1.25 - 1) / 2 + 1 / 1) / 2 sequences
        ("seq_mean_token_sum_norm", -0.15625),  # (-1.25 - 1 + 1) / (2 sequences * 4)
    ],
)
def test_aggregation_modes_through_the_policy_loss(aggregation: str, want: float) -> None:
    config = dataclasses.replace(DAPO_CLIP, aggregation=aggregation, max_len_norm=4)
    value, _ = _value_and_grad(config)
    assert value == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize(
    ("ratio", "advantage", "dual_clip", "want", "clipped"),
    [
        (4.0, -1.0, None, 4.0, False),  # max(4, 1.2) = 4: the unbounded negative-A case
        (4.0, -1.0, 3.0, 3.0, True),  # dual clip caps it at -A * 3 = 3
        (2.0, -1.0, 3.0, 2.0, False),  # max(2, 1.2) = 2 < 3: dual clip not binding
        (4.0, 1.0, 3.0, -1.2, True),  # positive A: max(-4, -1.2); dual clip does not apply
        (0.7, -1.0, 3.0, 0.8, True),  # max(0.7, 0.8): clipped from below at 1 - 0.2
    ],
)
def test_clipped_surrogate_with_dual_clip(
    ratio: float, advantage: float, dual_clip: float | None, want: float, clipped: bool
) -> None:
    def loss(r: jax.Array) -> tuple[jax.Array, jax.Array]:
        out, is_clipped = clipped_surrogate(
            r, jnp.float32(advantage), clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=dual_clip
        )
        return out, is_clipped

    (value, is_clipped), grad = jax.value_and_grad(loss, has_aux=True)(jnp.float32(ratio))
    assert float(value) == pytest.approx(want, abs=1e-6)
    assert bool(is_clipped) == clipped
    # Clipped branches are constants in the ratio; the unclipped one has slope -A.
    assert float(grad) == pytest.approx(0.0 if clipped else -advantage)


def test_dual_clip_through_the_policy_loss() -> None:
    config = PolicyLossConfig(dual_clip=3.0)
    logprobs = _row(0.0, 0.0, math.log(4.0), fill=NEG_INF)
    value, grad = _value_and_grad(config, logprobs)
    # t1: -1, t2: -2 (ratio 1); t4: ratio 4, A=-1 -> min(max(4, 1.2), 3) = 3, zero gradient.
    assert value == pytest.approx((-1 - 2 + 3) / 3, abs=1e-6)
    np.testing.assert_allclose(grad, _row(-1 / 3, -2 / 3, 0.0), atol=1e-6)


def test_kl_loss_term_and_missing_reference() -> None:
    config = dataclasses.replace(DAPO_CLIP, kl=KLConfig(estimator="k1", coef=0.1, mode="loss"))
    value, grad = _value_and_grad(config, ref_logprobs=ZEROS)
    # k1 = logp - 0 = [ln 1.25, ln 0.5, 0]; loss adds 0.1 * (0.223144 - 0.693147) / 3.
    kl_mean = (math.log(1.25) + math.log(0.5)) / 3
    assert value == pytest.approx(-1.25 / 3 + 0.1 * kl_mean, abs=1e-6)
    # d k1 / d logp = 1, so each loss token's gradient gains 0.1 / 3.
    np.testing.assert_allclose(grad, _row(-1.15 / 3, -0.9 / 3, 1.1 / 3), atol=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        _loss(jnp.asarray(LOGPROBS), config)


# Off-policy: old - behaviour log-ratio ln 3, ln 0.5, 0 on the three loss tokens.
BEHAVIOR = _row(-math.log(3.0), -math.log(0.5), 0.0)
OFF_ADVANTAGES = _row(1.0, 1.0, -1.0)


def _off(correction: str, **fields) -> PolicyLossConfig:  # noqa: ANN003
    return PolicyLossConfig(off_policy=OffPolicyConfig(correction=correction, **fields))


def test_decoupled_ppo_clips_against_proximal_and_weights_by_truncated_behaviour_ratio() -> None:
    old = _row(0.0, 0.0, 0.0)
    logprobs = _row(math.log(1.25), 0.0, 0.0, fill=NEG_INF)
    arrays = {"behavior_logprobs": BEHAVIOR, "advantages": OFF_ADVANTAGES, "old_logprobs": old}
    value, grad = _value_and_grad(_off("decoupled", weight_cap=2.0), logprobs, **arrays)
    # weights w = min(pi_prox / pi_behav, 2) = [min(3, 2), 0.5, 1] = [2, 0.5, 1];
    # t1: ratio 1.25 vs proximal clipped at 1.2 -> 2 * -1.2 = -2.4 (zero gradient);
    # t2: 0.5 * -1 = -0.5; t4: 1 * 1 = 1.  Token mean (-2.4 - 0.5 + 1) / 3 = -0.633333.
    assert value == pytest.approx(-1.9 / 3, abs=1e-6)
    np.testing.assert_allclose(grad, _row(0.0, -0.5 / 3, 1 / 3), atol=1e-6)
    # Without correction the same inputs give (-1.2 - 1 + 1) / 3.
    plain, _ = _value_and_grad(PolicyLossConfig(), logprobs, **arrays)
    assert plain == pytest.approx(-0.4, abs=1e-6)
    # TIS with recomputed old log-probs is the same token-level formula.
    tis, _ = _value_and_grad(_off("tis", weight_cap=2.0), logprobs, **arrays)
    assert tis == pytest.approx(value, abs=1e-6)
    with pytest.raises(ValueError, match="old_logprobs"):
        _loss(jnp.asarray(logprobs), _off("decoupled"), behavior_logprobs=BEHAVIOR)


def test_tis_without_old_logprobs_uses_the_current_policy_as_old() -> None:
    logprobs = _row(0.0, 0.0, 0.0, fill=NEG_INF)
    arrays = {"behavior_logprobs": BEHAVIOR, "advantages": OFF_ADVANTAGES}
    config = _off("tis", weight_cap=2.0)
    value, grad = _value_and_grad(config, logprobs, **arrays)
    # Ratio 1 everywhere (old = stop_gradient(current)); w = min(pi / pi_behav, 2) = [2, 0.5, 1].
    # Loss (-2 - 0.5 + 1) / 3 = -0.5; gradient -w A / 3 = [-2, -0.5, 1] / 3.
    assert value == pytest.approx(-0.5, abs=1e-6)
    np.testing.assert_allclose(grad, _row(-2 / 3, -0.5 / 3, 1 / 3), atol=1e-6)
    metrics = _loss(jnp.asarray(logprobs), config, **arrays).metrics
    assert float(metrics["importance_weight_mean"]) == pytest.approx(3.5 / 3)
    assert float(metrics["clip_fraction"]) == 0.0


@pytest.mark.parametrize(
    ("sequence_ratio", "want_loss", "want_dropped"),
    [
        # Sequence 1: token ratios 1.2, 1.2 -> geometric mean 1.2 (kept, <= 1.3); sequence 2:
        # 0.4 (< 0.5, dropped). Loss (-1 - 1 + 0) / 3 tokens (the denominator keeps them all).
        ("geometric_mean", -2 / 3, 0.5),
        # Product 1.2 * 1.2 = 1.44 > 1.3: both sequences dropped.
        ("product", 0.0, 1.0),
    ],
)
def test_sequence_masking_drops_sequences_outside_the_band(
    sequence_ratio: str, want_loss: float, want_dropped: float
) -> None:
    behavior = _row(-math.log(1.2), -math.log(1.2), -math.log(0.4))
    config = _off("sequence_mask", mask_low=0.5, mask_high=1.3, sequence_ratio=sequence_ratio)
    arrays = {"behavior_logprobs": behavior, "advantages": OFF_ADVANTAGES}
    logprobs = _row(0.0, 0.0, 0.0, fill=NEG_INF)
    value, _ = _value_and_grad(config, logprobs, **arrays)
    assert value == pytest.approx(want_loss, abs=1e-6)
    metrics = _loss(jnp.asarray(logprobs), config, **arrays).metrics
    assert float(metrics["masked_sequence_fraction"]) == pytest.approx(want_dropped)


def test_gspo_sequence_ratio_is_exp_of_mean_token_log_ratio() -> None:
    old = _row(0.0, 0.0, 0.0)
    logprobs = _row(math.log(2.0), 0.0, math.log(0.5), fill=NEG_INF)
    # Sequence 1: exp((ln 2 + 0) / 2) = sqrt 2; sequence 2: exp(ln 0.5) = 0.5; 1 off the mask.
    want = np.ones((2, 5), np.float32)
    want[0, 1] = want[0, 2] = math.sqrt(2.0)
    want[0, 4] = 0.5
    for level in ("sequence", "sequence_token"):
        got = importance_ratio(logprobs, old, LOSS_MASK, SEGMENT_IDS, level=level, max_segments=M)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    # GSPO's tight clip (3e-4 / 4e-4): sqrt 2 with A=+1 is clipped at 1.0004, 0.5 with A=-1 at
    # 0.9997, so neither sequence passes a gradient.
    config = RLAlgorithmConfig.gspo().policy_loss
    advantages = _row(1.0, 1.0, -1.0)
    value, grad = _value_and_grad(config, logprobs, old_logprobs=old, advantages=advantages)
    assert value == pytest.approx((-1.0004 + 0.9997) / 2, abs=1e-6)
    np.testing.assert_array_equal(grad, np.zeros_like(grad))


GSPO_LOGPROBS = _row(0.1, -0.05, 0.02, fill=NEG_INF)
S1 = math.exp((0.1 - 0.05) / 2)  # 1.025315, sequence 1's ratio
S2 = math.exp(0.02)  # 1.020201


@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
def test_gspo_and_gspo_token_agree_for_sequence_advantages(level: str) -> None:
    config = PolicyLossConfig(ratio_level=level, aggregation="seq_mean_token_mean")
    advantages = _row(1.5, 1.5, -0.5)
    value, grad = _value_and_grad(config, GSPO_LOGPROBS, advantages=advantages)
    # Unclipped: ((-1.5 * S1) + (0.5 * S2)) / 2 sequences = -0.513936.
    assert value == pytest.approx((-1.5 * S1 + 0.5 * S2) / 2, abs=1e-6)
    # Sequence 1: d(-1.5 S1)/d logp_t = -1.5 * S1 / 2 tokens, / 2 sequences = -0.384493 each.
    # Sequence 2: 0.5 * S2 / 1 token / 2 sequences = 0.255050.
    np.testing.assert_allclose(grad, _row(-1.5 * S1 / 4, -1.5 * S1 / 4, 0.5 * S2 / 2), atol=1e-6)


def test_gspo_token_uses_per_token_advantages_in_the_gradient() -> None:
    advantages = _row(1.0, 3.0, -0.5)
    token = PolicyLossConfig(ratio_level="sequence_token", aggregation="seq_mean_token_mean")
    sequence = dataclasses.replace(token, ratio_level="sequence")
    value_t, grad_t = _value_and_grad(token, GSPO_LOGPROBS, advantages=advantages)
    value_s, grad_s = _value_and_grad(sequence, GSPO_LOGPROBS, advantages=advantages)
    # Same value: ((-1 - 3) / 2 * S1 + 0.5 * S2) / 2.
    assert value_t == pytest.approx(value_s, abs=1e-6)
    assert value_t == pytest.approx((-2 * S1 + 0.5 * S2) / 2, abs=1e-6)
    # GSPO-token: token t's gradient is -A_t * S1 / 2 tokens / 2 sequences = [-S1/4, -3 S1/4].
    np.testing.assert_allclose(grad_t[0, 1:3], [-S1 / 4, -3 * S1 / 4], atol=1e-6)
    # GSPO: every token carries the sequence's mean advantage: -2 S1 * (1/2) / 2 = -S1/2 each.
    np.testing.assert_allclose(grad_s[0, 1:3], [-S1 / 2, -S1 / 2], atol=1e-6)


def test_all_masked_batch_is_zero_and_nan_free() -> None:
    mask = np.zeros_like(LOSS_MASK)
    for config in (
        RLAlgorithmConfig.gspo().policy_loss,
        RLAlgorithmConfig.dr_grpo(max_len_norm=4).policy_loss,
        _off("sequence_mask"),
        _off("tis"),
    ):
        value, grad = _value_and_grad(config, loss_mask=mask)
        assert value == 0.0
        np.testing.assert_array_equal(grad, np.zeros_like(grad))
        metrics = _loss(jnp.asarray(LOGPROBS), config, loss_mask=mask).metrics
        assert all(np.isfinite(float(v)) for v in metrics.values())


ACCUMULATION_CONFIGS = {
    "dapo_token_mean": RLAlgorithmConfig.dapo().policy_loss,
    "grpo_seq_mean_with_kl": RLAlgorithmConfig.grpo().policy_loss,
    "gspo": dataclasses.replace(RLAlgorithmConfig.gspo().policy_loss, clip_eps_high=0.1),
    "gspo_token": RLAlgorithmConfig.gspo_token().policy_loss,
    "dr_grpo_tis": dataclasses.replace(
        RLAlgorithmConfig.dr_grpo(max_len_norm=11).policy_loss,
        off_policy=OffPolicyConfig(correction="tis"),
    ),
    "sequence_mask_dual_clip": dataclasses.replace(
        _off("sequence_mask", mask_low=0.8, mask_high=1.25), dual_clip=2.0
    ),
}


@pytest.fixture(scope="module")
def random_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    segments = np.array(
        [
            [1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 0],
            [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
            [1, 1, 2, 2, 2, 2, 2, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        ],
        np.int32,
    )
    mask = (rng.random(segments.shape) < 0.75) & (segments > 0)
    mask[3] = False  # an all-masked row
    shape = segments.shape
    return {
        "segment_ids": segments,
        "loss_mask": mask,
        "features": rng.normal(size=(*shape, 5)).astype(np.float32),
        "advantages": rng.normal(size=shape).astype(np.float32),
        "behavior_logprobs": (-1.0 + 0.3 * rng.normal(size=shape)).astype(np.float32),
        "old_logprobs": (-1.0 + 0.1 * rng.normal(size=shape)).astype(np.float32),
        "ref_logprobs": (-1.0 + 0.2 * rng.normal(size=shape)).astype(np.float32),
    }


@pytest.mark.parametrize("name", list(ACCUMULATION_CONFIGS))
def test_micro_batch_accumulation_matches_the_full_batch(
    name: str, random_batch: dict[str, np.ndarray]
) -> None:
    config = ACCUMULATION_CONFIGS[name]
    batch = random_batch
    weights = jnp.asarray(np.linspace(-0.3, 0.4, 5, dtype=np.float32))
    old = None if name == "dr_grpo_tis" else batch["old_logprobs"]  # TIS: current policy as old

    @functools.partial(jax.jit, static_argnames=("start", "stop"))
    def loss_and_grad(w: jax.Array, denominator: jax.Array, start: int, stop: int):  # noqa: ANN202
        def loss(w: jax.Array) -> jax.Array:
            rows = slice(start, stop)
            logprobs = -1.0 + 0.2 * jnp.tanh(batch["features"][rows] @ w)
            out = policy_loss(
                logprobs,
                advantages=batch["advantages"][rows],
                behavior_logprobs=batch["behavior_logprobs"][rows],
                loss_mask=batch["loss_mask"][rows],
                segment_ids=batch["segment_ids"][rows],
                old_logprobs=None if old is None else old[rows],
                ref_logprobs=batch["ref_logprobs"][rows],
                config=config,
                max_segments=3,
                denominator=denominator,
            )
            return out.terms.value()

        return jax.value_and_grad(loss)(w)

    denominator = aggregation_denominator(
        batch["loss_mask"],
        batch["segment_ids"],
        mode=config.aggregation,
        max_segments=3,
        max_len_norm=config.max_len_norm,
    )
    full_loss, full_grad = loss_and_grad(weights, denominator, 0, 4)
    assert abs(float(full_loss)) > 1e-3 and float(jnp.abs(full_grad).max()) > 1e-3  # non-trivial
    total_loss, total_grad = 0.0, jnp.zeros_like(weights)
    for start, stop in ((0, 2), (2, 4)):  # the second half holds the all-masked row
        loss, grad = loss_and_grad(weights, denominator, start, stop)
        total_loss, total_grad = total_loss + loss, total_grad + grad
    assert float(total_loss) == pytest.approx(float(full_loss), abs=1e-6)
    np.testing.assert_allclose(total_grad, full_grad, atol=1e-6)


def test_policy_loss_jits_with_its_metrics() -> None:
    config = dataclasses.replace(
        RLAlgorithmConfig.gspo().policy_loss, off_policy=_off("tis").off_policy
    )
    jitted = jax.jit(functools.partial(policy_loss, config=config, max_segments=M))
    inputs = {
        "advantages": ADVANTAGES,
        "behavior_logprobs": BEHAVIOR,
        "loss_mask": LOSS_MASK,
        "segment_ids": SEGMENT_IDS,
    }
    got = jitted(jnp.asarray(LOGPROBS), **inputs)
    want = policy_loss(jnp.asarray(LOGPROBS), config=config, max_segments=M, **inputs)
    assert float(got.terms.value()) == pytest.approx(float(want.terms.value()), abs=1e-6)
    assert set(got.metrics) == set(want.metrics)
    for name, value in got.metrics.items():
        assert float(value) == pytest.approx(float(want.metrics[name]), abs=1e-6), name
