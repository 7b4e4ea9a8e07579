"""Frozen configs that select an RL algorithm: which advantages, which ratio, which clipping.

GRPO, Dr.GRPO, DAPO, GSPO, GSPO-token, PPO and RLOO are not classes: they are choices of the same
pure functions in `advantages.py`, `policy_loss.py`, `kl.py`, `aggregation.py` and
`value_loss.py`, named here as presets of `RLAlgorithmConfig`. Preset values follow the papers
(noted per preset); every field can be overridden with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from nonstop.models.validation import check as _check
from nonstop.models.validation import check_choice

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "gae"]
RatioLevel = Literal["token", "sequence", "sequence_token"]
AggregationMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
KLMode = Literal["loss", "reward"]
OffPolicyCorrection = Literal["none", "decoupled", "tis", "sequence_mask"]
SequenceRatio = Literal["geometric_mean", "product"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How episode rewards become advantages.

    `grpo` normalises by group mean and std, `dr_grpo` only subtracts the group mean, `rloo`
    subtracts the mean of the other episodes, `gae` uses a value model (PPO).
    """

    estimator: AdvantageEstimator = "grpo"
    std_eps: float = 1e-6  # GRPO: advantage = (r - mean) / (std + std_eps)
    gamma: float = 1.0  # GAE discount
    lam: float = 0.95  # GAE lambda
    whiten: bool = False  # GAE: normalise advantages over the step's batch (PPO practice)

    def __post_init__(self) -> None:
        check_choice("AdvantageConfig", "estimator", self.estimator, AdvantageEstimator)
        _check(self.std_eps > 0, "AdvantageConfig", "std_eps", self.std_eps, "> 0")
        _check(0.0 <= self.gamma <= 1.0, "AdvantageConfig", "gamma", self.gamma, "in [0, 1]")
        _check(0.0 <= self.lam <= 1.0, "AdvantageConfig", "lam", self.lam, "in [0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KLConfig:
    """KL to a frozen reference policy: estimator, coefficient, and where it enters.

    `mode="loss"` adds `coef * kl` per token to the policy loss (GRPO); `mode="reward"` subtracts
    `coef * kl` from the per-token rewards before advantages (PPO, RLOO). `coef=0` disables it and
    then no reference log-probs are needed.
    """

    estimator: KLEstimator = "k3"
    coef: float = 0.0
    mode: KLMode = "loss"

    def __post_init__(self) -> None:
        check_choice("KLConfig", "estimator", self.estimator, KLEstimator)
        check_choice("KLConfig", "mode", self.mode, KLMode)
        _check(self.coef >= 0, "KLConfig", "coef", self.coef, ">= 0")

    @property
    def enabled(self) -> bool:
        return self.coef > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffPolicyConfig:
    """Correction for tokens sampled by older weights than the ones being trained.

    - `none`: the ratio is taken against `old_logprobs` if given, else `behavior_logprobs`.
    - `decoupled` (decoupled PPO, AReaL): clip the ratio against the proximal policy
      (`old_logprobs`, required) and weight each token by min(pi_prox / pi_behav, weight_cap).
    - `tis` (token-level truncated importance sampling): weight each token by
      min(pi_old / pi_behav, weight_cap); without `old_logprobs`, pi_old is the current policy
      with its gradient stopped, so no extra forward pass is needed.
    - `sequence_mask` (MIS / sequence masking): a sequence whose ratio pi_old / pi_behav lies
      outside [mask_low, mask_high] contributes nothing; `sequence_ratio` says whether that ratio
      is the length-normalised geometric mean of the token ratios or their product.
    """

    correction: OffPolicyCorrection = "none"
    weight_cap: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 2.0
    sequence_ratio: SequenceRatio = "geometric_mean"

    def __post_init__(self) -> None:
        owner = "OffPolicyConfig"
        check_choice(owner, "correction", self.correction, OffPolicyCorrection)
        check_choice(owner, "sequence_ratio", self.sequence_ratio, SequenceRatio)
        _check(self.weight_cap >= 1.0, owner, "weight_cap", self.weight_cap, ">= 1")
        _check(0.0 <= self.mask_low <= 1.0, owner, "mask_low", self.mask_low, "in [0, 1]")
        _check(self.mask_high >= 1.0, owner, "mask_high", self.mask_high, ">= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """The actor loss: ratio level, clip range, dual clip, aggregation, off-policy and KL terms.

    `ratio_level`: `token` (PPO/GRPO/DAPO), `sequence` (GSPO: one length-normalised ratio per
    sequence) or `sequence_token` (GSPO-token: the sequence ratio's value with per-token
    gradients). `dual_clip` (Ye et al. 2020) caps the loss of negative-advantage tokens at
    `dual_clip * |A|`. `max_len_norm` is the constant length of `seq_mean_token_sum_norm`.
    """

    ratio_level: RatioLevel = "token"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float | None = None
    aggregation: AggregationMode = "token_mean"
    max_len_norm: int | None = None
    off_policy: OffPolicyConfig = OffPolicyConfig()
    kl: KLConfig = KLConfig()

    def __post_init__(self) -> None:
        owner = "PolicyLossConfig"
        check_choice(owner, "ratio_level", self.ratio_level, RatioLevel)
        check_choice(owner, "aggregation", self.aggregation, AggregationMode)
        _check(
            0.0 <= self.clip_eps_low < 1.0, owner, "clip_eps_low", self.clip_eps_low, "in [0, 1)"
        )
        _check(self.clip_eps_high >= 0.0, owner, "clip_eps_high", self.clip_eps_high, ">= 0")
        _check(
            self.dual_clip is None or self.dual_clip > 1.0,
            owner, "dual_clip", self.dual_clip, "None or > 1",
        )  # fmt: skip
        if self.aggregation == "seq_mean_token_sum_norm":
            _check(
                self.max_len_norm is not None and self.max_len_norm > 0,
                owner, "max_len_norm", self.max_len_norm,
                "a positive int when aggregation='seq_mean_token_sum_norm'",
            )  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValueLossConfig:
    """PPO critic loss: 0.5 * max((V - R)^2, (clip(V, V_old +- clip_eps) - R)^2) times `coef`."""

    coef: float = 0.5
    clip_eps: float | None = 0.2

    def __post_init__(self) -> None:
        _check(self.coef >= 0, "ValueLossConfig", "coef", self.coef, ">= 0")
        _check(
            self.clip_eps is None or self.clip_eps > 0,
            "ValueLossConfig", "clip_eps", self.clip_eps, "None or > 0",
        )  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlongConfig:
    """DAPO's soft overlong punishment, measured in response tokens.

    No penalty up to `max_response_tokens - buffer_tokens`, then a linear ramp to `-penalty` at
    `max_response_tokens`, and `-penalty` beyond it.
    """

    max_response_tokens: int
    buffer_tokens: int
    penalty: float = 1.0

    def __post_init__(self) -> None:
        owner = "OverlongConfig"
        _check(self.max_response_tokens > 0, owner, "max_response_tokens",
               self.max_response_tokens, "> 0")  # fmt: skip
        _check(0 < self.buffer_tokens <= self.max_response_tokens, owner, "buffer_tokens",
               self.buffer_tokens, f"in (0, max_response_tokens={self.max_response_tokens}]")  # fmt: skip
        _check(self.penalty >= 0, owner, "penalty", self.penalty, ">= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLAlgorithmConfig:
    """One RL algorithm: advantages, actor loss, optional critic, entropy, DAPO's extras."""

    name: str = "custom"
    advantage: AdvantageConfig = AdvantageConfig()
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    value: ValueLossConfig | None = None
    entropy_coef: float = 0.0
    overlong: OverlongConfig | None = None
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal

    def __post_init__(self) -> None:
        owner = "RLAlgorithmConfig"
        _check(self.entropy_coef >= 0, owner, "entropy_coef", self.entropy_coef, ">= 0")
        uses_gae = self.advantage.estimator == "gae"
        _check(
            uses_gae == (self.value is not None),
            owner, "value", self.value,
            "a ValueLossConfig exactly when advantage.estimator == 'gae' "
            f"(estimator is {self.advantage.estimator!r})",
        )  # fmt: skip

    @property
    def kl(self) -> KLConfig:
        return self.policy_loss.kl

    # Presets. Values follow the cited papers; override with dataclasses.replace.

    @classmethod
    def grpo(cls) -> RLAlgorithmConfig:
        """GRPO (Shao et al. 2024, DeepSeekMath): group-normalised advantages, token ratio clipped
        at 0.2, per-sequence token means, k3 KL to the reference in the loss with beta 0.04."""
        return cls(
            name="grpo",
            advantage=AdvantageConfig(estimator="grpo"),
            policy_loss=PolicyLossConfig(
                aggregation="seq_mean_token_mean", kl=KLConfig(estimator="k3", coef=0.04)
            ),
        )

    @classmethod
    def dr_grpo(cls, *, max_len_norm: int = 1024) -> RLAlgorithmConfig:
        """Dr.GRPO (Liu et al. 2025): no std normalisation, token sums over a constant length,
        no KL. `max_len_norm` should be the generation budget in tokens."""
        return cls(
            name="dr_grpo",
            advantage=AdvantageConfig(estimator="dr_grpo"),
            policy_loss=PolicyLossConfig(
                aggregation="seq_mean_token_sum_norm", max_len_norm=max_len_norm
            ),
        )

    @classmethod
    def dapo(
        cls, *, max_response_tokens: int = 20480, buffer_tokens: int = 4096
    ) -> RLAlgorithmConfig:
        """DAPO (Yu et al. 2025): clip-higher (0.2 / 0.28), token-level mean, no KL, soft overlong
        punishment (20480 tokens, 4096 buffer), dynamic sampling."""
        return cls(
            name="dapo",
            advantage=AdvantageConfig(estimator="grpo"),
            policy_loss=PolicyLossConfig(
                clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token_mean"
            ),
            overlong=OverlongConfig(
                max_response_tokens=max_response_tokens, buffer_tokens=buffer_tokens
            ),
            dynamic_sampling=True,
        )

    @classmethod
    def gspo(cls) -> RLAlgorithmConfig:
        """GSPO (Zheng et al. 2025): length-normalised sequence ratio clipped at 3e-4 / 4e-4."""
        return cls(
            name="gspo",
            advantage=AdvantageConfig(estimator="grpo"),
            policy_loss=PolicyLossConfig(
                ratio_level="sequence",
                clip_eps_low=3e-4,
                clip_eps_high=4e-4,
                aggregation="seq_mean_token_mean",
            ),
        )

    @classmethod
    def gspo_token(cls) -> RLAlgorithmConfig:
        """GSPO-token: GSPO's ratio value with per-token gradients, for per-token advantages."""
        base = cls.gspo()
        return dataclasses.replace(
            base,
            name="gspo_token",
            policy_loss=dataclasses.replace(base.policy_loss, ratio_level="sequence_token"),
        )

    @classmethod
    def ppo(cls) -> RLAlgorithmConfig:
        """PPO with a value model (Ouyang et al. 2022 style): GAE(1.0, 0.95) whitened, clip 0.2,
        clipped value loss (coef 0.5), k1 KL as a per-token reward penalty with beta 0.02."""
        return cls(
            name="ppo",
            advantage=AdvantageConfig(estimator="gae", gamma=1.0, lam=0.95, whiten=True),
            policy_loss=PolicyLossConfig(
                aggregation="token_mean", kl=KLConfig(estimator="k1", coef=0.02, mode="reward")
            ),
            value=ValueLossConfig(coef=0.5, clip_eps=0.2),
        )

    @classmethod
    def rloo(cls) -> RLAlgorithmConfig:
        """RLOO (Ahmadian et al. 2024): leave-one-out baseline, token ratio clipped at 0.2, k1 KL
        as a reward penalty with beta 0.05 (TRL's default)."""
        return cls(
            name="rloo",
            advantage=AdvantageConfig(estimator="rloo"),
            policy_loss=PolicyLossConfig(
                aggregation="token_mean", kl=KLConfig(estimator="k1", coef=0.05, mode="reward")
            ),
        )

    @classmethod
    def for_run(cls, name: str, *, budget: int, kl_coef: float | None = None
                ) -> RLAlgorithmConfig:
        """Preset `name` with its length constants set from a run's sampled-token `budget`:
        Dr.GRPO's constant normaliser and DAPO's overlong limit are the budget (the papers'
        values assume budgets of thousands of tokens), DAPO's soft-punishment buffer a fifth of
        it (4096 of 20480 in the paper); `kl_coef` (None: the preset's) replaces the KL weight."""
        if name == "dr_grpo":
            algorithm = cls.dr_grpo(max_len_norm=budget)
        elif name == "dapo":
            algorithm = cls.dapo(max_response_tokens=budget, buffer_tokens=max(1, budget // 5))
        else:
            algorithm = cls.preset(name)
        if kl_coef is None:
            return algorithm
        loss = algorithm.policy_loss
        kl = dataclasses.replace(loss.kl, coef=kl_coef)
        return dataclasses.replace(algorithm, policy_loss=dataclasses.replace(loss, kl=kl))

    @classmethod
    def preset(cls, name: str) -> RLAlgorithmConfig:
        """A preset by name: one of `PRESETS`."""
        check_choice("RLAlgorithmConfig", "name", name, PRESETS)
        return getattr(cls, name)()


PRESETS: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "ppo", "rloo")
