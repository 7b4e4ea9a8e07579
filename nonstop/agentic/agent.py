"""`Agent`: runs one episode against the engine and returns its `Trajectory`.

    agent = Agent(engine, AgentConfig(max_turns=4, max_tokens_per_turn=64))
    trajectory = await agent.run_episode(interaction, group_id=3, episode_id=13, seed=s)

The loop: generate (in the episode's engine session, so only the new tokens are prefilled) →
append the sampled ids with their log-probs and policy versions → `interaction.step` (tools,
environment) → append what it returns → … until the interaction says done or a limit is hit
(turns, sampled tokens, context length, wall clock), then the reward. The trajectory is built
only here and only from ids: the engine is always given `trajectory.tokens`, so what it saw at
every turn is a prefix of the final trajectory, and nothing the model generated is re-tokenized.

An episode never raises (except when cancelled): an exception from the environment, a tool, the
reward or the engine ends it with status "error", the cause in `info["error"]`, and reward 0;
the group queue then drops its group. A timeout of the whole episode ends it with status
"timeout" and its complete turns kept (a cut-off episode is trained like any other).

Each turn samples with its own seed, derived from the episode's: reruns reproduce the episode,
and the episodes of a group (different seeds) differ.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Literal

import numpy as np

from nonstop import perf
from nonstop.agentic.config import AgentConfig
from nonstop.agentic.trajectory_builder import Interaction
from nonstop.engine import RolloutClient, SamplingParams
from nonstop.rl.trajectory import Trajectory

EpisodeStatus = Literal["done", "max_turns", "max_tokens", "context_full", "timeout", "error"]
EPISODE_STATUS = perf.ROLLOUT_EPISODE_STATUS  # counter, tagged status=...


class StepTimeoutError(RuntimeError):
    """An environment step (tools included) ran past `AgentConfig.step_timeout_s`."""


def derive_seed(*keys: int) -> int:
    """A 32-bit seed from integer keys (NumPy's SeedSequence hashing: distinct keys, distinct
    streams)."""
    return int(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys])
               .generate_state(1, np.uint32)[0])


class Agent:
    """Runs episodes on one engine with one `AgentConfig`; safe to share between tasks."""

    def __init__(self, engine: RolloutClient, config: AgentConfig | None = None) -> None:
        self.engine = engine
        self.config = config or AgentConfig()
        limit = engine.config.max_len
        self.max_context = min(self.config.max_context_tokens or limit, limit)

    def _params(self, turn_seed: int, budget: int) -> SamplingParams:
        c = self.config
        stops = () if c.ignore_eos else c.sampling.stop_token_ids
        return dataclasses.replace(c.sampling, max_tokens=budget, stop_token_ids=stops,
                                   seed=turn_seed)

    async def run_episode(self, interaction: Interaction, *, group_id: int, episode_id: int,
                          seed: int) -> Trajectory:
        """Run one episode to its end; see the module docstring for what can end it."""
        started = time.perf_counter()
        info: dict[str, Any] = {"turns": 0, "turn_log": [], "status": "error", "seed": seed,
                                "generate_s": 0.0, "env_s": 0.0, "started_at": started}
        trajectory: Trajectory | None = None
        session = None
        timeout = self.config.episode_timeout_s
        try:
            session = self.engine.session()
            async with asyncio.timeout(timeout):
                with perf.span(perf.ROLLOUT_ENV, stage="start", episode=episode_id):
                    opening = await interaction.start()
                trajectory = _opening(opening, group_id, episode_id)
                info["status"] = await self._turns(interaction, trajectory, session, seed, info)
        except TimeoutError:
            info["status"] = "timeout"
        except asyncio.CancelledError:
            interaction.close()
            raise
        except Exception as error:  # noqa: BLE001 - isolated to this episode and recorded
            info["status"], info["error"] = "error", f"{type(error).__name__}: {error}"
        finally:
            if session is not None:
                session.close()
        if trajectory is None:
            trajectory = _opening([], group_id, episode_id)
        reward = 0.0
        if info["status"] != "error":
            try:
                with perf.span(perf.ROLLOUT_REWARD, episode=episode_id):
                    async with asyncio.timeout(self.config.step_timeout_s):
                        reward = await interaction.reward()
                if not np.isfinite(reward):
                    raise ValueError(f"the reward is {reward}")
            except Exception as error:  # noqa: BLE001 - a failed reward fails the episode
                info["status"], info["error"] = "error", f"reward: {type(error).__name__}: {error}"
                reward = 0.0
        interaction.close()
        info["finished_at"] = time.perf_counter()
        info["duration_s"] = info["finished_at"] - started
        trajectory.reward = float(reward)
        trajectory.info.update(info)
        perf.count(perf.ROLLOUT_EPISODES, 1)
        perf.count(EPISODE_STATUS, 1, status=info["status"])
        return trajectory

    async def _turns(self, interaction: Interaction, trajectory: Trajectory, session: Any,
                     seed: int, info: dict[str, Any]) -> EpisodeStatus:
        c = self.config
        sampled_total = 0
        for turn in range(c.max_turns):
            room = self.max_context - len(trajectory)
            budget = min(c.max_tokens_per_turn, c.max_episode_tokens - sampled_total, room)
            if budget < 1:
                return "context_full" if room < 1 else "max_tokens"
            turn_seed = derive_seed(seed, turn)
            t0 = time.perf_counter()
            with perf.span(perf.ROLLOUT_GENERATE, turn=turn):
                completion = await self.engine.generate(
                    trajectory.tokens, self._params(turn_seed, budget), session=session)
            t1 = time.perf_counter()
            info["generate_s"] += t1 - t0
            info["turn_log"].append({
                "prompt_length": len(trajectory), "sampled": len(completion.tokens),
                "seed": turn_seed, "finish_reason": completion.finish_reason,
                "prefilled": completion.num_prefilled, "cached": completion.num_cached,
                "t_submit": t0, "t_done": t1})
            trajectory.append(completion.tokens, sampled=True, logprobs=completion.logprobs,
                              versions=completion.policy_versions)
            sampled_total += len(completion.tokens)
            info["turns"] = turn + 1
            with perf.span(perf.ROLLOUT_ENV, stage="step", episode=trajectory.episode_id,
                           turn=turn):
                try:
                    async with asyncio.timeout(c.step_timeout_s):
                        result = await interaction.step(completion.tokens,
                                                        completion.finish_reason)
                except TimeoutError:  # not the episode's own timeout: the environment hung
                    raise StepTimeoutError(f"step {turn} took over {c.step_timeout_s}s") from None
            info["env_s"] += time.perf_counter() - t1
            info["turn_log"][-1]["t_env_done"] = time.perf_counter()
            if result.info:
                info["last_step_info"] = dict(result.info)
            if len(trajectory) + len(result.tokens) > self.max_context:
                return "context_full"  # the observation does not fit: end before it
            if result.tokens:
                trajectory.append(result.tokens, sampled=False)
            if result.done:
                return "done"
        return "max_turns"


def _opening(tokens: Any, group_id: int, episode_id: int) -> Trajectory:
    ids = np.asarray(tokens, np.int32).reshape(-1)
    n = ids.shape[0]
    return Trajectory(tokens=ids, loss_mask=np.zeros(n, bool),
                      behavior_logprobs=np.zeros(n, np.float32),
                      policy_version=np.full(n, -1, np.int32), group_id=group_id,
                      episode_id=episode_id, prompt_length=n)
