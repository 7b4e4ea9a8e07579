"""The optimisation half of every RL learner: scored trajectories in, optimizer steps out.

`PolicyTrainer` owns the train state and one jitted step. Given a step's trajectories (already
scored, with per-episode advantages), it packs them into fixed-shape `TrainBatch`es, computes
the log-probs the algorithm needs before any update (old/proximal policy for μ > 1 or decoupled
PPO, the reference policy for KL), then runs μ inner epochs of optimizer steps over the batches.
The streaming learner (`agentic.streaming`) feeds it, for `nonstop rl` and `nonstop agentic`
alike; given the same trajectories in the same order it takes exactly the same steps.

The reference policy is a frozen copy of the initial trainable weights, or, when only LoRA
adapters train, the same model with the adapters zeroed (no second copy of the base). KL to it
is either a loss term (`kl.mode="loss"`, inside the jitted step) or a reward penalty
(`kl.mode="reward"`): per token on GAE's token rewards (PPO), or summed over each episode's
sampled tokens and subtracted from its reward before group advantages (`sequence_kl`, RLOO).
Both read the behaviour log-probs, i.e. the policy that sampled, as verl does.

PPO (`algorithm.value` set) adds a `Critic`: before the first update of a step, the critic
scores every packed row, GAE turns token rewards (the episode reward on its last sampled token,
minus the KL penalty) into advantages and returns, advantages are whitened over the whole step,
and each policy step is followed by a critic step on the clipped value loss.

Under `jax.distributed` (`mesh=distributed.global_mesh(...)`, one packing bucket) each process
passes only its own trajectories: they fill its rows of every global batch, and a process with
fewer batches pads with empty ones, so all take the same steps and run the same reference passes
(`sequence_kl`). PPO whitens with the mean and std over every process's tokens, and the step's
`advantage_mean_raw` / `advantage_std_raw` / `reward_kl` are over all processes too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from nonstop import perf
from nonstop.models import Decoder
from nonstop.models.validation import check, check_ints
from nonstop.rl.aggregation import aggregate
from nonstop.rl.config import RLAlgorithmConfig
from nonstop.rl.critic import Critic, ValueBatch, ValueModel
from nonstop.rl.kl import kl_estimate
from nonstop.rl.policy_loss import policy_loss
from nonstop.rl.trajectory import Trajectory
from nonstop.rl.value_loss import gae, token_entropy
from nonstop.train import (
    OptimizerConfig,
    PackedBatch,
    PackingConfig,
    PackingStats,
    TokenSequence,
    TrainBatch,
    distributed,
    pack_least_padding,
    setup_train_step,
    target_mask,
    token_logprobs,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyTrainerConfig:
    algorithm: RLAlgorithmConfig = RLAlgorithmConfig.grpo()
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-5, schedule="constant")
    packing: PackingConfig = PackingConfig(buckets=(64, 128, 256, 512), rows_per_batch=8)
    inner_epochs: int = 1  # μ: passes over each step's batches
    grad_accum_steps: int = 1
    lora_only: bool = False  # train only nnx.LoRAParam (the reference is then adapters-off)
    critic_optimizer: OptimizerConfig | None = None  # PPO's value model; None: `optimizer`'s
    seed: int = 0

    def __post_init__(self) -> None:
        owner = "PolicyTrainerConfig"
        check_ints(owner, self, ("inner_epochs", "grad_accum_steps"))
        rows = self.packing.rows_per_batch
        check(rows % self.grad_accum_steps == 0, owner, "packing.rows_per_batch", rows,
              f"a multiple of grad_accum_steps={self.grad_accum_steps}")


def trajectory_units(trajectories: Sequence[Trajectory], *, per_token: bool = False
                     ) -> list[tuple[TokenSequence]]:
    """One packing unit per trajectory, its advantage broadcast onto its sampled tokens.

    `per_token` (GAE): advantages are computed after packing, so they start at 0 here.
    """
    units = []
    for t in trajectories:
        if t.advantage is None and not per_token:
            raise ValueError(f"episode {t.episode_id} has no advantage; score its group first")
        value = 0.0 if per_token else t.advantage
        adv = np.where(t.loss_mask, np.float32(value), np.float32(0.0))
        units.append((TokenSequence(tokens=t.tokens, loss_mask=t.loss_mask, advantages=adv,
                                    behavior_logprobs=t.behavior_logprobs,
                                    origin=f"episode {t.episode_id}"),))
    return units


class PolicyTrainer:
    """Train state, the jitted RL step, and the log-prob passes it needs."""

    def __init__(self, model: Decoder, cfg: PolicyTrainerConfig, *,
                 mesh: Mesh | None = None) -> None:
        self.cfg = cfg
        self.algorithm = cfg.algorithm
        self.max_segments = cfg.packing.max_segments_per_row
        self.mesh = mesh
        kl = self.algorithm.kl
        self.kl_in_reward = kl.enabled and kl.mode == "reward"
        self.needs_reference = kl.enabled
        self._check_processes()
        setup = setup_train_step(model, self._loss, cfg.optimizer, seed=cfg.seed,
                                 wrt=nnx.LoRAParam if cfg.lora_only else nnx.Param,
                                 grad_accum_steps=cfg.grad_accum_steps, mesh=mesh)
        self.state, self._step = setup.state, setup.step
        self._batch_sharding = setup.batch_sharding
        self._logprobs = setup.jit_rows(self._logprob_pass)
        self._sequence_kl = setup.jit_rows(self._sequence_kl_pass)
        self._reference_params = None
        if self.needs_reference:
            params = self.state.params
            self._reference_params = (jax.tree.map(jnp.zeros_like, params) if cfg.lora_only
                                      else jax.tree.map(jnp.copy, params))
        correction = self.algorithm.policy_loss.off_policy.correction
        self.needs_old = cfg.inner_epochs > 1 or correction == "decoupled"
        self.steps_taken = 0
        self.critic: Critic | None = None
        if self.algorithm.value is not None:
            loss = self.algorithm.policy_loss
            self.critic = Critic(ValueModel.from_policy(model), self.algorithm.value,
                                 optimizer=cfg.critic_optimizer or cfg.optimizer,
                                 aggregation=loss.aggregation, max_segments=self.max_segments,
                                 max_len_norm=loss.max_len_norm,
                                 grad_accum_steps=cfg.grad_accum_steps, seed=cfg.seed + 1,
                                 mesh=mesh)
            self._gae = setup.jit_rows(self._gae_pass)

    def _check_processes(self) -> None:
        """Under `jax.distributed` each process trains on its own trajectories, in rows of the
        global batch; that needs the global mesh and one batch shape for every process."""
        if jax.process_count() == 1:
            return
        if self.mesh is None:
            raise ValueError(f"PolicyTrainer: {jax.process_count()} processes need the global "
                             "mesh (mesh=distributed.global_mesh(...))")
        if len(self.cfg.packing.buckets) != 1:
            raise ValueError(
                f"PolicyTrainer: with several processes every process must take steps of the "
                f"same shape; use a single packing bucket, not {self.cfg.packing.buckets}")

    # ---- pure functions (jitted) ---------------------------------------------------------------

    def _loss(self, model: Decoder, batch: TrainBatch, rng: jax.Array):
        logits, _ = model(batch.tokens, batch.positions, batch.segment_ids)
        logp = token_logprobs(logits, batch.tokens)
        mask = target_mask(batch.loss_mask, batch.segment_ids)
        out = policy_loss(logp, advantages=batch.advantages,
                          behavior_logprobs=batch.behavior_logprobs, loss_mask=mask,
                          segment_ids=batch.segment_ids, config=self.algorithm.policy_loss,
                          max_segments=self.max_segments, old_logprobs=batch.old_logprobs,
                          ref_logprobs=batch.ref_logprobs)
        numerator = out.terms.numerator
        # The step reports the accumulated loss itself; keep the per-batch value under its own name.
        metrics = {("policy_loss" if k == "loss" else k): v for k, v in out.metrics.items()}
        # The policy's entropy on the sampled positions: a bonus with entropy_coef, else only
        # reported (no gradient flows through it).
        bonus = self.algorithm.entropy_coef > 0
        ent = aggregate(token_entropy(logits if bonus else jax.lax.stop_gradient(logits)), mask,
                        batch.segment_ids, mode=self.algorithm.policy_loss.aggregation,
                        max_segments=self.max_segments,
                        max_len_norm=self.algorithm.policy_loss.max_len_norm)
        if bonus:
            numerator = numerator - self.algorithm.entropy_coef * ent.numerator
        metrics["entropy"] = ent.value()
        return numerator, out.terms.denominator, metrics

    def _logprob_pass(self, params: nnx.State, frozen: nnx.State, batch: TrainBatch) -> jax.Array:
        model = nnx.merge(self.state.graphdef, params, frozen)
        logits, _ = model(batch.tokens, batch.positions, batch.segment_ids)
        return token_logprobs(logits, batch.tokens)

    def _reward_kl(self, batch: TrainBatch) -> jax.Array:
        """float32[B,T] per-token KL(behaviour || reference), 0 off the targets."""
        mask = target_mask(batch.loss_mask, batch.segment_ids)
        return kl_estimate(batch.behavior_logprobs, batch.ref_logprobs, mask,
                           estimator=self.algorithm.kl.estimator)

    def _sequence_kl_pass(self, params: nnx.State, frozen: nnx.State,
                          batch: TrainBatch) -> jax.Array:
        """float32[B,T] per-token KL(behaviour || reference) of a batch without ref log-probs."""
        ref = self._logprob_pass(params, frozen, batch)
        return self._reward_kl(dataclasses.replace(batch, ref_logprobs=ref))

    def _gae_pass(self, values: jax.Array, token_rewards: jax.Array,
                  batch: TrainBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(advantages, returns, kl) float32[B,T] for one packed batch scored by the critic."""
        mask = target_mask(batch.loss_mask, batch.segment_ids)
        kl = jnp.zeros_like(token_rewards)
        if self.kl_in_reward:
            kl = self._reward_kl(batch)
            token_rewards = token_rewards - self.algorithm.kl.coef * kl
        advantage = self.algorithm.advantage
        adv, returns = gae(token_rewards, values, mask, batch.segment_ids,
                           gamma=advantage.gamma, lam=advantage.lam)
        return adv, returns, kl

    # ---- host side -----------------------------------------------------------------------------

    @property
    def uses_gae(self) -> bool:
        return self.critic is not None

    def pack(self, trajectories: Sequence[Trajectory]) -> list[PackedBatch]:
        units = trajectory_units(trajectories, per_token=self.uses_gae)
        return pack_least_padding(units, self.cfg.packing)

    def sequence_kl(self, trajectories: Sequence[Trajectory]) -> np.ndarray:
        """float32[E]: each episode's summed per-token KL(behaviour || reference) on its sampled
        tokens, the episode-level KL penalty of `kl.mode="reward"` for group estimators."""
        if not self.needs_reference:
            raise ValueError(f"{self.algorithm.name} has no KL term (kl.coef=0); nothing to sum")
        units = [(TokenSequence(tokens=t.tokens, loss_mask=t.loss_mask,
                                behavior_logprobs=t.behavior_logprobs,
                                origin=f"episode {t.episode_id}"),) for t in trajectories]
        sums = []
        with perf.span(perf.TRAIN_DATA_WAIT, stage="reference_kl"):
            batches = pack_least_padding(units, self.cfg.packing)
            if jax.process_count() > 1:  # every process runs the same reference passes
                missing = distributed.max_over_processes(len(batches)) - len(batches)
                batches += [self._empty_batch()] * missing
            for packed in batches:
                kl = self._sequence_kl(self._reference_params, self.state.frozen,
                                       self._put(packed.batch))
                sums += [float(x.sum()) for x in packed.gather(distributed.local_part(kl))]
        return np.asarray(sums, np.float32)

    def _gae_advantages(self, trajectories: Sequence[Trajectory], packed: list[PackedBatch],
                        batches: list[TrainBatch]) -> tuple[list[TrainBatch], list[ValueBatch],
                                                            dict[str, float]]:
        """GAE on every packed batch, whitened over the whole step (every process's tokens);
        the critic's targets.

        `packed` are this process's host batches, `batches` the matching (global) device
        batches. Each process reads back its own rows of the advantages, the whitening mean and
        std come from token counts and sums over all processes, and the whitened advantages go
        back into the global batch.
        """
        assert self.critic is not None
        episodes = iter(trajectories)
        raw = []
        for p, batch in zip(packed, batches, strict=True):
            rewards = np.zeros(p.batch.shape, np.float32)  # this process's rows
            for place in p.placements:
                t = next(episodes)
                sampled = np.flatnonzero(t.loss_mask[:place.length])
                if sampled.size:  # the episode's reward sits on its last sampled token
                    rewards[place.row, place.start + sampled[-1]] = np.float32(t.reward)
            values = self.critic.values(batch)
            adv, returns, kl = self._gae(values, self._put(rewards), batch)
            mask = np.asarray(target_mask(p.batch.loss_mask, p.batch.segment_ids))
            raw.append((batch, values, distributed.local_part(adv), returns,
                        distributed.local_part(kl), mask))
        adv_tokens = np.concatenate([a[m] for _, _, a, _, _, m in raw]).astype(np.float64)
        kl_tokens = np.concatenate([k[m] for *_, k, m in raw]).astype(np.float64)
        count, adv_sum, adv_squares, kl_sum = distributed.sum_over_processes(
            [adv_tokens.size, adv_tokens.sum(), np.square(adv_tokens).sum(), kl_tokens.sum()])
        mean, std, reward_kl = 0.0, 1.0, 0.0
        if count:
            mean = adv_sum / count
            std = np.sqrt(max(adv_squares / count - mean**2, 0.0))
            reward_kl = kl_sum / count
        whiten = self.algorithm.advantage.whiten
        out_batches, value_batches = [], []
        for batch, values, adv, returns, _, mask in raw:
            if whiten:
                scaled = (adv.astype(np.float64) - mean) / np.sqrt(std**2 + 1e-8)
                out_batches.append(dataclasses.replace(
                    batch, advantages=self._put(np.where(mask, scaled, 0.0).astype(np.float32))))
            else:
                out_batches.append(dataclasses.replace(batch, advantages=self._put(adv)))
            value_batches.append(ValueBatch(batch=batch, old_values=values, returns=returns))
        stats = {"advantage_mean_raw": float(mean), "advantage_std_raw": float(std),
                 "reward_kl": float(reward_kl)}
        return out_batches, value_batches, stats

    def _empty_batch(self) -> PackedBatch:
        """A batch of this trainer's (single-bucket) shape with no tokens, for a process that
        has fewer batches than another: stepping on it adds nothing to the gradient sums."""
        shape = (self.cfg.packing.rows_per_batch, self.cfg.packing.buckets[0])
        floats = {name: np.zeros(shape, np.float32)
                  for name in ("advantages", "behavior_logprobs")}
        batch = TrainBatch(tokens=np.zeros(shape, np.int32), positions=np.zeros(shape, np.int32),
                           segment_ids=np.zeros(shape, np.int32),
                           loss_mask=np.zeros(shape, bool), **floats)
        return PackedBatch(batch=batch, stats=PackingStats(), placements=())

    def _put(self, batch: Any) -> Any:
        """A packed host batch (or one [B,T] array of it) on the trainer's devices: one device,
        the mesh, or (several processes) this process's rows of the global batch."""
        if self._batch_sharding is None:
            return jax.tree.map(jnp.asarray, batch)
        if jax.process_count() == 1:
            return jax.device_put(batch, self._batch_sharding)
        rows = self.cfg.packing.rows_per_batch * jax.process_count()
        return distributed.global_batch(batch, self._batch_sharding, rows)

    def _with_logprobs(self, packed: PackedBatch) -> TrainBatch:
        batch = self._put(packed.batch)
        changes: dict[str, Any] = {}
        if self.needs_old:
            changes["old_logprobs"] = self._logprobs(self.state.params, self.state.frozen, batch)
        if self.needs_reference:
            changes["ref_logprobs"] = self._logprobs(self._reference_params, self.state.frozen,
                                                     batch)
        return dataclasses.replace(batch, **changes) if changes else batch

    def train(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """μ epochs of optimizer steps over the trajectories; returns the mean of the metrics
        (of those named *_max, the max)."""
        if not trajectories and jax.process_count() == 1:
            raise ValueError("train() needs at least one trajectory")
        packed = self.pack(trajectories) if trajectories else []
        if jax.process_count() > 1:  # every process takes the same number of steps
            missing = distributed.max_over_processes(len(packed)) - len(packed)
            packed += [self._empty_batch()] * missing
            if not packed:
                return {"optimizer_steps": 0.0, "packed_rows": 0.0}
        with perf.span(perf.TRAIN_DATA_WAIT, stage="logprobs"):
            batches = [self._with_logprobs(p) for p in packed]
        value_batches: list[ValueBatch] = []
        extra: dict[str, float] = {}
        if self.critic is not None:
            with perf.span(perf.TRAIN_DATA_WAIT, stage="gae"):
                batches, value_batches, extra = self._gae_advantages(trajectories, packed,
                                                                     batches)
        collected: list[dict[str, jax.Array]] = []
        for _ in range(self.cfg.inner_epochs):
            for index, batch in enumerate(batches):
                with perf.span(perf.TRAIN_STEP, step=self.steps_taken):
                    with perf.device_busy(perf.TRAINER):
                        self.state, metrics = self._step(self.state, batch)
                        jax.block_until_ready(metrics)
                if self.critic is not None:
                    metrics = {**metrics, **self.critic.fit(value_batches[index])}
                self.steps_taken += 1
                collected.append(metrics)
        perf.count(perf.TRAIN_TOKENS, int(sum(p.stats.real_tokens for p in packed)))
        # Means over the micro-batches, except maxima (e.g. behavior_logprob_gap_max).
        out = {k: float((np.max if k.endswith("_max") else np.mean)([float(m[k])
                                                                     for m in collected]))
               for k in collected[0]}
        out.update(extra)
        out["optimizer_steps"] = float(len(collected))
        out["packed_rows"] = float(sum(p.stats.rows_used for p in packed))
        return out

    def model(self) -> Decoder:
        return self.state.model()

    def policy_params(self) -> nnx.State:
        """The full parameter state an engine needs (trainable merged with frozen)."""
        return nnx.state(self.state.model(), nnx.Param)
