"""The batch RL learner: prompts → engine rollouts (G per prompt) → rewards → advantages →
packed train steps (μ inner epochs) → weight update to the engine.

This is the synchronous baseline: every step collects its groups, then trains, then syncs the
engine's weights. Rollouts still run concurrently inside a step (all G·P requests are in the
engine at once). Dynamic sampling (DAPO) drops groups whose rewards are all equal and samples
more prompts, up to `max_sampling_rounds`, then applies `on_no_variance`. A reward that fails
or returns NaN follows `reward_on_error` (see `evaluate_rewards`): invalid episodes are dropped
and counted, so nothing non-finite ever reaches the loss.

Every request's seed is derived from (seed, step, episode), so a run resumed from a checkpoint
draws the same samples as the uninterrupted run and continues the same reward curve.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from nonstop import perf
from nonstop.engine import Engine, SamplingParams
from nonstop.models import Tokenizer
from nonstop.models.validation import check, check_int, check_ints
from nonstop.rl.advantages import episode_advantages, overlong_penalty
from nonstop.rl.policy_trainer import PolicyTrainer
from nonstop.rl.prompts import PromptFormat, answer_text, encode_prompt
from nonstop.rl.rewards import Example, OnError, Reward, evaluate_rewards
from nonstop.rl.trajectory import Trajectory
from nonstop.train import distributed


class NoVarianceError(RuntimeError):
    """Dynamic sampling found no group with reward variance within its limit."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """G samples of each of `prompts_per_step` prompts, each up to `max_new_tokens` tokens, drawn
    with `sampling`'s temperature, top-k and top-p (its `max_tokens`, stops and seed stay unset:
    the budget above, the tokenizer's end-of-sequence ids and per-episode seeds apply)."""

    group_size: int = 8  # G
    prompts_per_step: int = 4
    max_new_tokens: int = 32
    sampling: SamplingParams = SamplingParams()
    prompt_format: PromptFormat = "raw"
    add_bos: bool = False

    RENAMED = {"temperature": "sampling.temperature", "top_k": "sampling.top_k",
               "top_p": "sampling.top_p"}

    def __post_init__(self) -> None:
        owner = "RolloutConfig"
        check_int(owner, "group_size", self.group_size, low=2)  # group-relative advantages
        check_ints(owner, self, ("prompts_per_step", "max_new_tokens"))
        s = self.sampling
        check(s.max_tokens is None and s.seed is None and not s.stop_token_ids and not s.stop,
              owner, "sampling", s, "only temperature, top_k and top_p set")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchLearnerConfig:
    rollout: RolloutConfig = RolloutConfig()
    steps: int = 100
    max_sampling_rounds: int = 4  # dynamic sampling: extra rounds of prompts per step
    on_no_variance: Literal["skip", "stop"] = "skip"
    reward_on_error: OnError = "skip"
    eval_every: int = 0  # steps between greedy held-out evaluations (0: only start and end)
    seed: int = 0


@dataclasses.dataclass
class StepStats:
    groups_kept: int = 0
    groups_dropped_no_variance: int = 0
    episodes_invalid: int = 0
    sampling_rounds: int = 0


class Learner:
    """Synchronous GRPO-family learner over a stream of `Example`s scored by one `Reward`."""

    def __init__(self, trainer: PolicyTrainer, engine: Engine, tokenizer: Tokenizer,
                 examples: Iterator[Example], reward: Reward, cfg: BatchLearnerConfig, *,
                 on_step: Callable[[int, dict[str, float]], None] | None = None) -> None:
        self.trainer = trainer
        self.engine = engine
        self.tokenizer = tokenizer
        self.examples = examples
        self.reward = reward
        self.cfg = cfg
        self.on_step = on_step
        self.step = 0
        self.failures: dict[str, int] = {}
        self._episode_ids = itertools.count()

    # ---- rollouts ------------------------------------------------------------------------------

    def _sampling(self, seed: int) -> SamplingParams:
        r = self.cfg.rollout
        return dataclasses.replace(r.sampling, max_tokens=r.max_new_tokens,
                                   stop_token_ids=tuple(self.tokenizer.eos_ids), seed=seed)

    async def _rollout_groups(self, examples: Sequence[Example], first_group: int,
                              seed_base: int, offset: int = 0) -> list[list[Trajectory]]:
        """G rollouts per example; group g of this batch is the step's group `offset + g` (its
        seeds and group id), so a prompt draws the same samples whichever process runs it."""
        r = self.cfg.rollout
        prompts = [encode_prompt(self.tokenizer, e.prompt, r.prompt_format, r.add_bos)
                   for e in examples]
        requests = []
        for g, prompt in enumerate(prompts):
            for i in range(r.group_size):
                seed = seed_base + (offset + g) * r.group_size + i
                requests.append(self.engine.generate(prompt, self._sampling(seed)))
        completions = await asyncio.gather(*requests)
        groups: list[list[Trajectory]] = []
        for g, prompt in enumerate(prompts):
            group = []
            for i in range(r.group_size):
                c = completions[g * r.group_size + i]
                group.append(Trajectory.from_completion(
                    prompt, c.tokens, c.logprobs, c.policy_versions,
                    group_id=first_group + offset + g,
                    episode_id=next(self._episode_ids), finish_reason=c.finish_reason))
            groups.append(group)
        return groups

    def answer_text(self, ids: Sequence[int]) -> str:
        """Sampled ids as the text a reward sees: stop tokens and special tokens dropped."""
        return answer_text(self.tokenizer, ids)

    def completion_text(self, t: Trajectory) -> str:
        return self.answer_text(t.tokens[t.prompt_length:])

    async def _score(self, groups: list[list[Trajectory]], examples: Sequence[Example],
                     stats: StepStats) -> list[list[Trajectory]]:
        """Rewards, overlong shaping and advantages; drops invalid episodes and flat groups."""
        flat = [t for g in groups for t in g]
        ex = [examples[i] for i, g in enumerate(groups) for _ in g]
        result = await evaluate_rewards(self.reward, [e.prompt for e in ex],
                                        [self.completion_text(t) for t in flat], ex,
                                        on_error=self.cfg.reward_on_error)
        for (name, reason), n in result.failure_counts.items():
            key = f"{name}/{reason}"
            self.failures[key] = self.failures.get(key, 0) + n
        rewards = np.asarray(result.rewards, np.float32)
        algorithm = self.trainer.algorithm
        if algorithm.overlong is not None:
            lengths = np.asarray([t.num_sampled for t in flat], np.float32)
            rewards = rewards + np.asarray(overlong_penalty(jnp.asarray(lengths),
                                                            algorithm.overlong))
        for t, r, ok in zip(flat, rewards, result.valid, strict=True):
            t.reward = float(r)
            t.info["reward_valid"] = bool(ok)
        kept = []
        for group in groups:
            valid = [t for t in group if t.info["reward_valid"]]
            stats.episodes_invalid += len(group) - len(valid)
            if len(valid) < 2:
                continue
            values = np.asarray([t.reward for t in valid], np.float32)
            if algorithm.dynamic_sampling and np.all(values == values[0]):
                stats.groups_dropped_no_variance += 1
                continue
            kept.append(valid)
        estimator = algorithm.advantage.estimator
        if estimator == "gae":
            return kept  # PPO: per-token advantages come from the critic inside the trainer
        penalties = [np.zeros(len(g), np.float32) for g in kept]
        if self.trainer.kl_in_reward and (kept or jax.process_count() > 1):
            # KL as a reward penalty for group estimators: each episode's summed per-token KL
            # (a collective with several processes: each calls it, with or without episodes).
            kl = self.trainer.sequence_kl([t for g in kept for t in g])
            sizes = np.cumsum([0] + [len(g) for g in kept])
            penalties = [algorithm.kl.coef * kl[a:b] for a, b in itertools.pairwise(sizes)]
        for group, penalty in zip(kept, penalties, strict=True):
            for t, p in zip(group, penalty, strict=True):
                t.info["kl_penalty"] = float(p)
            values = np.asarray([t.reward for t in group], np.float32) - penalty
            adv = episode_advantages(jnp.asarray(values), jnp.zeros(len(group), jnp.int32),
                                     num_groups=1, estimator=estimator,
                                     std_eps=algorithm.advantage.std_eps)
            for t, a in zip(group, np.asarray(adv), strict=True):
                t.advantage = float(a)
        return kept

    async def collect(self, step: int) -> tuple[list[list[Trajectory]], StepStats]:
        """This step's scored groups (dynamic sampling tops them up to prompts_per_step)."""
        r = self.cfg.rollout
        stats = StepStats()
        kept: list[list[Trajectory]] = []
        rounds = 1 + (self.cfg.max_sampling_rounds if self.trainer.algorithm.dynamic_sampling
                      else 0)
        processes, rank = jax.process_count(), jax.process_index()
        for round_ in range(rounds):
            need = r.prompts_per_step - len(kept)
            # Under jax.distributed every process draws the same examples (so the streams stay
            # in step) and rolls out its own contiguous block of them.
            need_all = distributed.max_over_processes(need)
            if need_all <= 0:
                break
            drawn = [next(self.examples) for _ in range(need_all * processes)]
            examples = drawn[rank * need_all:rank * need_all + max(need, 0)]
            seed_base = (self.cfg.seed * 1_000_003 + step * 10_007 + round_ * 1_009) * 4096
            with perf.span(perf.ROLLOUT_QUEUE_WAIT, step=step, stage="collect"):
                groups = await self._rollout_groups(examples, step * 1000 + round_ * 100,
                                                    seed_base, offset=rank * need_all)
            with perf.span(perf.ROLLOUT_REWARD, step=step):
                kept += await self._score(groups, examples, stats)
            stats.sampling_rounds = round_ + 1
        stats.groups_kept = len(kept)
        if not kept and self.cfg.on_no_variance == "stop":
            raise NoVarianceError(
                f"step {step}: no group had reward variance after {stats.sampling_rounds} rounds "
                f"of {r.prompts_per_step} prompts ({stats.groups_dropped_no_variance} flat groups,"
                f" {stats.episodes_invalid} invalid episodes); raise max_sampling_rounds, "
                "group_size or temperature, or set on_no_variance=skip")
        return kept, stats

    # ---- evaluation ----------------------------------------------------------------------------

    async def evaluate(self, examples: Sequence[Example]) -> float:
        """Mean reward of greedy completions on held-out examples."""
        r = self.cfg.rollout
        prompts = [encode_prompt(self.tokenizer, e.prompt, r.prompt_format, r.add_bos)
                   for e in examples]
        params = SamplingParams(temperature=0.0, max_tokens=r.max_new_tokens,
                                stop_token_ids=tuple(self.tokenizer.eos_ids))
        with perf.span(perf.TRAIN_EVAL, step=self.step):
            completions = await asyncio.gather(*[self.engine.generate(p, params)
                                                 for p in prompts])
            texts = [self.answer_text(c.tokens) for c in completions]
            result = await evaluate_rewards(self.reward, [e.prompt for e in examples], texts,
                                            list(examples), on_error="zero")
        return float(np.mean(result.rewards))

    # ---- the loop ------------------------------------------------------------------------------

    def sync_weights(self) -> None:
        with perf.span(perf.TRAIN_WEIGHT_SYNC, step=self.step):
            params = self.trainer.policy_params()
            if jax.process_count() > 1:  # each host's engine runs on its own devices
                params = distributed.fetch(params)
            self.engine.update_weights(params, self.step)

    async def train_step(self) -> dict[str, Any]:
        groups, stats = await self.collect(self.step)
        episodes = [t for g in groups for t in g]
        metrics: dict[str, Any] = {"step": self.step, **dataclasses.asdict(stats)}
        # Sums over every process's episodes (one process: its own).
        count, reward_sum, token_sum, kl_sum = distributed.sum_over_processes(
            [len(episodes), sum(t.reward for t in episodes),
             sum(t.num_sampled for t in episodes),
             sum(t.info.get("kl_penalty", 0.0) for t in episodes)])
        if count:
            metrics.update(reward_mean=float(reward_sum / count),
                           completion_tokens=float(token_sum / count))
            # Group estimators' episode-level KL penalty (PPO's is per token: the trainer's
            # `reward_kl`).
            if self.trainer.kl_in_reward and not self.trainer.uses_gae:
                metrics["kl_penalty"] = float(kl_sum / count)
        if episodes or jax.process_count() > 1:  # all processes take the same steps
            metrics.update(self.trainer.train(episodes))
        self.step += 1
        self.sync_weights()
        if self.on_step is not None:
            self.on_step(self.step, metrics)
        return metrics

    async def run(self, eval_examples: Sequence[Example] = ()) -> list[dict[str, Any]]:
        history = []
        if eval_examples:
            history.append({"step": self.step, "eval_reward": await self.evaluate(eval_examples)})
        while self.step < self.cfg.steps:
            metrics = await self.train_step()
            every = self.cfg.eval_every
            last = self.step == self.cfg.steps
            if eval_examples and ((every and self.step % every == 0) or last):
                metrics["eval_reward"] = await self.evaluate(eval_examples)
            history.append(metrics)
        return history
