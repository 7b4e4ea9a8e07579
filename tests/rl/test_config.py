"""Algorithm presets select the documented pieces; bad values name the field and the choices."""

import dataclasses

import pytest

from nonstop.models.validation import ConfigError
from nonstop.rl import (
    PRESETS,
    AdvantageConfig,
    KLConfig,
    OffPolicyConfig,
    OverlongConfig,
    PolicyLossConfig,
    RLAlgorithmConfig,
    ValueLossConfig,
)


def test_presets_select_the_papers_choices() -> None:
    configs = {name: RLAlgorithmConfig.preset(name) for name in PRESETS}
    assert {name: c.name for name, c in configs.items()} == {name: name for name in PRESETS}

    grpo = configs["grpo"]
    assert grpo.advantage.estimator == "grpo"
    assert grpo.policy_loss.aggregation == "seq_mean_token_mean"
    assert (grpo.kl.estimator, grpo.kl.coef, grpo.kl.mode) == ("k3", 0.04, "loss")

    dr = configs["dr_grpo"]
    assert dr.advantage.estimator == "dr_grpo"
    assert dr.policy_loss.aggregation == "seq_mean_token_sum_norm"
    assert not dr.kl.enabled

    dapo = configs["dapo"]
    assert (dapo.policy_loss.clip_eps_low, dapo.policy_loss.clip_eps_high) == (0.2, 0.28)
    assert dapo.policy_loss.aggregation == "token_mean"
    assert dapo.dynamic_sampling and dapo.overlong == OverlongConfig(
        max_response_tokens=20480, buffer_tokens=4096
    )

    assert configs["gspo"].policy_loss.ratio_level == "sequence"
    assert configs["gspo_token"].policy_loss.ratio_level == "sequence_token"
    assert configs["gspo"].policy_loss.clip_eps_high == 4e-4

    ppo = configs["ppo"]
    assert ppo.advantage.estimator == "gae" and ppo.value == ValueLossConfig(coef=0.5, clip_eps=0.2)
    assert ppo.kl.mode == "reward"
    assert configs["rloo"].advantage.estimator == "rloo"


@pytest.mark.parametrize(
    ("build", "field", "value"),
    [
        (lambda: AdvantageConfig(estimator="ppo"), "AdvantageConfig.estimator", "'ppo'"),
        (lambda: AdvantageConfig(lam=1.5), "AdvantageConfig.lam", "1.5"),
        (lambda: KLConfig(estimator="k4"), "KLConfig.estimator", "'k4'"),
        (lambda: KLConfig(coef=-0.1), "KLConfig.coef", "-0.1"),
        (lambda: OffPolicyConfig(correction="vtrace"), "OffPolicyConfig.correction", "'vtrace'"),
        (lambda: OffPolicyConfig(weight_cap=0.5), "OffPolicyConfig.weight_cap", "0.5"),
        (lambda: PolicyLossConfig(ratio_level="seq"), "PolicyLossConfig.ratio_level", "'seq'"),
        (lambda: PolicyLossConfig(dual_clip=0.9), "PolicyLossConfig.dual_clip", "0.9"),
        (
            lambda: PolicyLossConfig(aggregation="seq_mean_token_sum_norm"),
            "PolicyLossConfig.max_len_norm",
            "None",
        ),
        (
            lambda: OverlongConfig(max_response_tokens=8, buffer_tokens=9),
            "OverlongConfig.buffer_tokens",
            "9",
        ),
        (
            lambda: RLAlgorithmConfig(advantage=AdvantageConfig(estimator="gae")),
            "RLAlgorithmConfig.value",
            "None",
        ),
        (lambda: RLAlgorithmConfig.preset("ppo2"), "RLAlgorithmConfig.name", "'ppo2'"),
    ],
)
def test_bad_values_name_field_and_value(build, field: str, value: str) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError) as error:
        build()
    message = str(error.value)
    assert f"{field}={value} is invalid" in message


def test_configs_are_frozen_and_hashable() -> None:
    config = RLAlgorithmConfig.dapo()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.entropy_coef = 0.1  # type: ignore[misc]
    assert hash(config.policy_loss) == hash(RLAlgorithmConfig.dapo().policy_loss)
