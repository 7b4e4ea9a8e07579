"""The agentic RL recipe behind `nonstop agentic`: a built-in environment with tools, a model,
then GRPO-family training with the streaming learner (or the synchronous baseline).

    cfg = load_config(AgenticRunConfig, "nonstop/recipes/configs/agentic_calculator_tiny.yaml")
    summary = run_agentic(cfg)

Each episode is one environment instance behind the model's chat template (`ChatInteraction`);
the orchestrator keeps `max_concurrency` of them in flight while the learner trains, weights are
pushed every `sync_every` steps, and no episode starts that would train more than
`max_staleness` versions behind. Greedy solve rates on held-out tasks are measured before and
after training.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import importlib.util
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from nonstop import perf
from nonstop.agentic.config import (
    AgentConfig,
    OrchestratorConfig,
    RolloutConfig,
    StreamingLearnerConfig,
)
from nonstop.agentic.environment import HELD_OUT_SEED, Environment, Split, draw_task
from nonstop.agentic.envs import (
    BM25Index,
    CalculatorEnv,
    GridWorldEnv,
    PythonEnv,
    RetrievalEnv,
    generate_corpus,
)
from nonstop.agentic.envs.calculator import CalculatorConfig
from nonstop.agentic.orchestrator import EpisodeSpec, RolloutOrchestrator
from nonstop.agentic.parsers import get_parser
from nonstop.agentic.ray_backend import RayEnvConfig, RayEnvironmentPool, import_ray, init_ray
from nonstop.agentic.streaming import (
    SOLVED_REWARD,
    GroupCursor,
    StepRecord,
    StreamingLearner,
    SyncLearner,
)
from nonstop.agentic.trajectory_builder import ChatInteraction
from nonstop.engine import EngineConfig, RolloutClient, gc_heap_frozen
from nonstop.engine.placement import PlacementConfig
from nonstop.models import Tokenizer
from nonstop.models.chat_templates import ChatFormat
from nonstop.models.checkpoint import save_pretrained
from nonstop.models.lora import LoRAConfig, apply_lora, has_lora, merge_lora
from nonstop.models.source import ModelSource, TokenizerSource, build_model, build_tokenizer
from nonstop.models.validation import check, check_int
from nonstop.perf import busy_fraction, read_events
from nonstop.recipes.agentic_warmup import WarmupSettings, warm_up
from nonstop.recipes.config_io import dump_config
from nonstop.recipes.custom_env import check_custom_env, make_custom_env, uses_custom_env
from nonstop.recipes.learner_state import (
    LearnerCheckpoints,
    RunStopped,
    TerminationGuard,
    resumed_group_ids,
)
from nonstop.recipes.rl_recipe import AlgorithmName, multi_host_mesh
from nonstop.recipes.run import start_run
from nonstop.recipes.tasks.custom import TaskSource
from nonstop.rl.config import RLAlgorithmConfig
from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
from nonstop.train import (
    CheckpointConfig,
    MetricsConfig,
    MetricsWriter,
    OptimizerConfig,
    PackingConfig,
    distributed,
)
from nonstop.train.metrics import truncate_jsonl

EnvName = Literal["calculator", "gridworld", "python", "retrieval"]
EnvBackend = Literal["local", "ray"]
# Training draws split "train" of the environment, evaluation split "eval" (`draw_task`): the
# built-in environments split their problems by a hash; a seed-only environment (a user's, a
# hub adapter) gets held-out tasks from seeds EVAL_SEED_OFFSET + i. Evaluation samples with
# seeds offset by it too.
EVAL_SEED_OFFSET = HELD_OUT_SEED
RL_PHASE = "main/agentic_rl"  # the span around the learner's run, for figures over RL alone
GROUPS_LOG = "groups.jsonl"  # the group ids each learner step trained
FINAL_MODEL_DIR = "final_model"  # the trained policy, RUN_DIR/final_model


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvSettings:
    name: EnvName = "calculator"
    max_operand: int = 20  # calculator
    with_tools_in_prompt: bool = True  # render tool schemas into the system prompt
    chat_format: ChatFormat = "qwen"  # which tool-call format the parser reads
    backend: EnvBackend = "local"  # "ray": reset/step run in Ray actors (see docs/scaling.md)
    ray: RayEnvConfig = RayEnvConfig()  # with backend "ray": cluster address, actors
    # A user's environment, or tools + reward + tasks, by import path (recipes/custom_env.py).
    path: str | None = None  # "my_pkg.envs:MyEnv": an Environment class or a factory
    args: Any = None  # keyword arguments for `path`
    tools: tuple[str, ...] = ()  # "my_pkg.tools:search": plain functions, sync or async
    reward: str | None = None  # "my_pkg.rewards:score": (prompt, completion, example) -> float
    tasks: TaskSource | None = None  # prompts and answers for `tools`: JSONL or a function
    system_prompt: str | None = None  # with `tools`

    def __post_init__(self) -> None:
        check(self.backend in ("local", "ray"), "EnvSettings", "backend", self.backend,
              "'local' (in-process) or 'ray' (Ray actors)")
        check(self.backend != "ray" or importlib.util.find_spec("ray") is not None,
              "EnvSettings", "backend", self.backend,
              "'local': 'ray' needs the `ray` package (`pip install nonstop[ray]`)")
        check_custom_env(self)  # imports every path now: a mistake stops the config loading


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgenticRunConfig:
    """Everything one `nonstop agentic` run needs."""

    algorithm: AlgorithmName = "grpo"
    kl_coef: float | None = 0.0  # None: the algorithm's default (e.g. PPO's per-token penalty)
    learner: Literal["streaming", "sync"] = "streaming"
    run_dir: str = "runs/agentic"
    seed: int = 0
    steps: int = 20
    num_eval: int = 64
    model: ModelSource = ModelSource(family="qwen3")
    tokenizer: TokenizerSource = TokenizerSource(kind="char")
    lora: LoRAConfig | None = None
    # SFT on the environment's demonstrations before RL (warmup.steps > 0), for a model built
    # from scratch: recipes/agentic_warmup.py.
    warmup: WarmupSettings = WarmupSettings()
    env: EnvSettings = EnvSettings()
    group_size: int = 8
    groups_per_step: int = 8
    max_staleness: int = 1
    sync_every: int = 1
    max_concurrency: int = 64
    agent: AgentConfig = AgentConfig(max_turns=3, max_tokens_per_turn=96, max_episode_tokens=256)
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-4, schedule="constant",
                                                 weight_decay=0.0)
    critic_optimizer: OptimizerConfig | None = None  # ppo's value model; None: `optimizer`
    packing: PackingConfig = PackingConfig(buckets=(320, 512, 1024), rows_per_batch=16,
                                           max_segments_per_row=4, overlong="truncate")
    engine: EngineConfig = EngineConfig(max_slots=64, max_len=512)
    rollout: RolloutConfig = RolloutConfig()  # rollout.backend: local (Engine) or vllm
    # Held-out evaluation every `eval_every` steps (0: before and after training only): the
    # greedy solve rate and, with `pass_k`, pass@k (k samples per task at the training
    # temperature; a task passes when one of them solves it).
    eval_every: int = 0
    pass_k: int = 0
    # Checkpoints of the learner (policy, optimizer, critic, group cursor) every
    # `checkpoint.save_every` steps, at the end and on SIGTERM; running the same command on the
    # same run_dir resumes from the latest.
    checkpoint: CheckpointConfig = CheckpointConfig(save_every=10, keep_last=2)
    # Per-step metrics: RUN_DIR/metrics.jsonl and TensorBoard as each step ends; W&B with
    # metrics.wandb=true.
    metrics: MetricsConfig = MetricsConfig()

    def __post_init__(self) -> None:
        check_int("AgenticRunConfig", "eval_every", self.eval_every, low=0)
        check_int("AgenticRunConfig", "pass_k", self.pass_k, low=0)
        check(self.max_concurrency >= self.group_size, "AgenticRunConfig", "max_concurrency",
              self.max_concurrency, f"at least group_size={self.group_size}, so that a group's "
              "episodes can be in flight together")
        self.algorithm_config()  # validates the algorithm's settings up front
        self.learner_config(self.agent)  # and the learner's (staleness, sync cadence)

    def learner_config(self, agent: AgentConfig) -> StreamingLearnerConfig:
        """The learner's settings, its episodes run with `agent`."""
        return StreamingLearnerConfig(
            groups_per_step=self.groups_per_step, max_staleness=self.max_staleness,
            sync_every=self.sync_every,
            orchestrator=OrchestratorConfig(group_size=self.group_size,
                                            max_concurrency=self.max_concurrency,
                                            seed=self.seed, agent=agent))

    def algorithm_config(self) -> RLAlgorithmConfig:
        """The named preset, with its length constants (Dr.GRPO's normaliser, DAPO's overlong
        limit) set from the episode's sampled-token budget, `agent.max_episode_tokens`."""
        return RLAlgorithmConfig.for_run(self.algorithm, budget=self.agent.max_episode_tokens,
                                         kl_coef=self.kl_coef)


def make_env(cfg: EnvSettings) -> Environment:
    if uses_custom_env(cfg):
        return make_custom_env(cfg, eval_seed_offset=EVAL_SEED_OFFSET)
    if cfg.name == "calculator":
        return CalculatorEnv(CalculatorConfig(max_operand=cfg.max_operand))
    if cfg.name == "python":  # model code runs in the sandbox (refused where it has no boundary)
        return PythonEnv()
    if cfg.name == "retrieval":
        documents, tasks, index = _retrieval_corpus()
        return RetrievalEnv(documents=documents, tasks=tasks, index=index)
    return GridWorldEnv()


@functools.cache
def _retrieval_corpus() -> tuple[list, list, BM25Index]:
    """The generated corpus, its questions and their BM25 index: built once per process, shared
    by every episode's environment."""
    documents, tasks = generate_corpus(0)
    return documents, tasks, BM25Index(documents)


@contextlib.contextmanager
def env_backend(cfg: EnvSettings) -> Iterator[Callable[[], Environment]]:
    """What builds each episode's environment: in-process, or on Ray actors (joining
    `cfg.ray.address`, or starting a local Ray when none is running) that live for the block."""
    if cfg.backend == "local":
        yield functools.partial(make_env, cfg)
        return
    started = init_ray(cfg.ray)
    try:
        with RayEnvironmentPool(functools.partial(make_env, cfg), cfg.ray) as pool:
            yield pool.environment
    finally:
        if started:
            import_ray().shutdown()


def interaction_factory(cfg: AgenticRunConfig, tokenizer: Tokenizer, split: Split,
                        new_env: Callable[[], Environment] | None = None):
    """Episodes on task `group_id` of `split` (training: seeds from `cfg.seed` on)."""
    parser = get_parser(cfg.env.chat_format)
    new_env = new_env or functools.partial(make_env, cfg.env)
    first = cfg.seed if split == "train" else 0

    def make(spec: EpisodeSpec) -> ChatInteraction:
        env = new_env()
        return ChatInteraction(env, tokenizer, parser,
                               task=draw_task(env, first + spec.group_id, split),
                               seed=spec.seed, with_tools=cfg.env.with_tools_in_prompt)

    return make


def agent_config(cfg: AgenticRunConfig, tokenizer: Tokenizer, *, greedy: bool = False
                 ) -> AgentConfig:
    """`cfg.agent` with the tokenizer's end-of-sequence ids as stops unless it names its own;
    `greedy`: temperature 0 (evaluation), else the configured sampling (training)."""
    sampling = cfg.agent.sampling
    stops = sampling.stop_token_ids or tuple(tokenizer.eos_ids)
    sampling = dataclasses.replace(sampling, stop_token_ids=stops,
                                   **({"temperature": 0.0} if greedy else {}))
    return dataclasses.replace(cfg.agent, sampling=sampling)


async def _prompt_lengths(cfg: AgenticRunConfig, tokenizer: Tokenizer) -> dict[str, int]:
    """Token counts of the first training prompt and the first held-out one."""
    lengths = {}
    for name, split in (("training", "train"), ("held-out", "eval")):
        interaction = interaction_factory(cfg, tokenizer, split)(
            EpisodeSpec(group_id=0, index=0, episode_id=0, seed=cfg.seed))
        try:
            lengths[name] = len(await interaction.start())
        finally:
            interaction.close()
    return lengths


def check_prompts_fit(cfg: AgenticRunConfig, tokenizer: Tokenizer) -> None:
    """Refuse, before any model is built, a run whose prompts leave no room to sample in the
    engine's context (every episode would end `context_full` and train on nothing)."""
    limit = cfg.agent.max_context_tokens
    key = "agent.max_context_tokens" if limit and limit < cfg.engine.max_len else "engine.max_len"
    room = min(cfg.engine.max_len, limit or cfg.engine.max_len)
    for split, length in asyncio.run(_prompt_lengths(cfg, tokenizer)).items():
        check(length < room, "AgenticRunConfig", key, room,
              f"more than the {length} tokens of a {split} prompt of env {cfg.env.name!r}, with "
              f"room for the answer (e.g. {key}={length + cfg.agent.max_episode_tokens})")


async def held_out_rewards(engine: RolloutClient, cfg: AgenticRunConfig, tokenizer: Tokenizer,
                           new_env: Callable[[], Environment] | None = None, *,
                           samples: int = 1, greedy: bool = True, step: int | None = None
                           ) -> list[list[float]]:
    """Rewards of `samples` episodes on each of this process's held-out tasks (with several
    processes, each runs a block of the `num_eval` tasks on its own engine): greedy, or at the
    training sampling with seeds fixed per (task, sample), so evaluations are comparable."""
    orchestrator = RolloutOrchestrator(
        engine, interaction_factory(cfg, tokenizer, "eval", new_env),
        OrchestratorConfig(group_size=samples, max_concurrency=cfg.max_concurrency,
                           seed=cfg.seed + EVAL_SEED_OFFSET,
                           agent=agent_config(cfg, tokenizer, greedy=greedy)))
    tasks = np.array_split(np.arange(cfg.num_eval), jax.process_count())[jax.process_index()]
    with perf.span(perf.TRAIN_EVAL, step=step):
        groups = await orchestrator.run_groups([int(i) for i in tasks])
    await orchestrator.close()
    return [[t.reward or 0.0 for t in groups[int(i)]] for i in tasks if int(i) in groups]


async def _over_tasks(values: list[float], cfg: AgenticRunConfig) -> float:
    """The mean of per-task `values` over every process's tasks."""
    if jax.process_count() > 1:  # a collective: off the event loop
        total = await asyncio.to_thread(distributed.sum_over_processes, [sum(values)])
        return float(total[0] / cfg.num_eval)
    return float(np.mean(values)) if values else 0.0


async def solve_rate(engine: RolloutClient, cfg: AgenticRunConfig, tokenizer: Tokenizer,
                     new_env: Callable[[], Environment] | None = None, *,
                     step: int | None = None) -> float:
    """Mean reward of greedy episodes on the held-out tasks."""
    rewards = await held_out_rewards(engine, cfg, tokenizer, new_env, step=step)
    return await _over_tasks([r[0] for r in rewards], cfg)


async def evaluate(engine: RolloutClient, cfg: AgenticRunConfig, tokenizer: Tokenizer,
                   new_env: Callable[[], Environment] | None = None, *,
                   step: int | None = None) -> dict[str, float]:
    """`solve_rate` (greedy) and, with `cfg.pass_k`, `pass@k` on the held-out tasks."""
    out = {"solve_rate": await solve_rate(engine, cfg, tokenizer, new_env, step=step)}
    if cfg.pass_k:
        rewards = await held_out_rewards(engine, cfg, tokenizer, new_env, samples=cfg.pass_k,
                                         greedy=False, step=step)
        passed = [float(max(r) >= SOLVED_REWARD) for r in rewards]
        out[f"pass@{cfg.pass_k}"] = await _over_tasks(passed, cfg)
    return out


async def train_with_progress(learner: StreamingLearner | SyncLearner, steps: int,
                              show: bool, group_ids: Iterator[int] | None = None,
                              first_step: int = 0) -> list[StepRecord]:
    """Run the learner with a progress bar fed from its step records."""
    run = asyncio.create_task(learner.run(steps, group_ids))
    with tqdm(total=first_step + steps, initial=first_step, unit="step", disable=not show,
              desc=f"agentic {type(learner).__name__}") as bar:
        while not run.done():
            await asyncio.wait({run}, timeout=0.5)
            records = learner.records
            if first_step + len(records) > bar.n:
                bar.update(first_step + len(records) - bar.n)
                bar.set_postfix(reward=f"{records[-1].reward_mean:.2f}",
                                staleness=max(records[-1].staleness, default=0))
    return run.result()


def engine_busy_during(perf_dir: str | Path, phase: str = RL_PHASE) -> float | None:
    """The engine's busy fraction inside the (last) span named `phase` of a finished run."""
    events = read_events(perf_dir).events
    spans = [e for e in events if e.name == phase]
    if not spans:
        return None
    return busy_fraction(events, perf.ENGINE, (spans[-1].t0, spans[-1].t1))


def run_agentic(cfg: AgenticRunConfig, *, model=None, progress: bool = True) -> dict[str, Any]:
    """Train; `model` (optional) replaces the configured one (e.g. an SFT-warmed model; a
    resumed run must be given the same one: it is the KL reference).

    Resumes from RUN_DIR's latest checkpoint if there is one. Records into `RUN_DIR/perf` unless
    a perf run is already active (then the caller owns it and `engine_busy_fraction` is None:
    compute it with `engine_busy_during` once that run ends). Raises `RunStopped` after a
    SIGTERM, once the checkpoint is written.
    """
    # Under `jax.distributed` every process runs this with its own engine and environments on
    # its share of each step's groups; the trainer steps on the global batch.
    # 1. The run directory and the tokenizer.
    run = start_run(cfg, cfg.run_dir)
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    check_prompts_fit(cfg, tokenizer)
    started = time.perf_counter()
    owns_perf = perf.active_run_dir() is None
    processes = jax.process_count()
    with perf.run(run.own / "perf") if owns_perf else contextlib.nullcontext():
        # 2. The policy (warmed up first if the config says so), its trainer and the checkpoint
        # to resume from.
        warmup_seconds = 0.0
        if cfg.warmup.steps:
            if model is not None:
                raise ValueError(f"warmup.steps={cfg.warmup.steps} with a model given: the "
                                 "warm-up trains the configured model; give none, or set "
                                 "warmup.steps=0")
            warmup_started = time.perf_counter()
            model = warm_up(cfg, make_env(cfg.env), tokenizer, run.root, progress=progress)
            warmup_seconds = time.perf_counter() - warmup_started
        model = model if model is not None else build_model(cfg.model, tokenizer, seed=cfg.seed)
        if cfg.lora is not None:
            model = apply_lora(model, cfg.lora, seed=cfg.seed)
        trainer = PolicyTrainer(model, PolicyTrainerConfig(
            algorithm=cfg.algorithm_config(), optimizer=cfg.optimizer,
            critic_optimizer=cfg.critic_optimizer, packing=cfg.packing,
            lora_only=cfg.lora is not None, seed=cfg.seed),
            mesh=multi_host_mesh(PlacementConfig()) if processes > 1 else None)
        checkpoints = LearnerCheckpoints.open(cfg.checkpoint, run, trainer.critic is not None)
        resumed = checkpoints.restore(trainer, run)
        start = resumed.step if resumed is not None else 0
        writer = MetricsWriter(run.own, dataclasses.replace(cfg.metrics, progress_bar=False),
                               resume_step=start if resumed is not None else None,
                               run_config=dump_config(cfg))
        # 3. The engine and the environments: evaluate, train with the learner, evaluate.
        # Several processes: each host's engine holds a local copy of the initial model (the
        # trainer's arrays span every host) and takes the trainer's weights as they are pushed.
        engine_model = trainer.model() if processes == 1 else model
        with cfg.rollout.build(engine_model, cfg.engine, tokenizer=tokenizer, policy_version=start
                               ) as engine, env_backend(cfg.env) as new_env, TerminationGuard() as guard:
            if processes > 1 and start:
                engine.update_weights(distributed.fetch(trainer.policy_params()), start)
            distributed.barrier("rollout weights published")  # shared servers: by process 0
            if resumed is not None and "eval_before" in resumed.data:
                before = dict(resumed.data["eval_before"])  # the first run's starting figures
            else:
                before = asyncio.run(evaluate(engine, cfg, tokenizer, new_env, step=start))
            learner_cls = StreamingLearner if cfg.learner == "streaming" else SyncLearner
            learner = learner_cls(trainer, engine,
                                  interaction_factory(cfg, tokenizer, "train", new_env),
                                  cfg.learner_config(agent_config(cfg, tokenizer)))
            log = StepLog(cfg, learner, writer, checkpoints, guard, before,
                          functools.partial(evaluate, engine, cfg, tokenizer, new_env))
            learner.on_step = log
            cursor = resumed.cursor if resumed is not None else GroupCursor()
            group_ids = resumed_group_ids(cursor, cfg.groups_per_step)
            rl_started = time.perf_counter()
            with perf.span(RL_PHASE), gc_heap_frozen():
                records = asyncio.run(train_with_progress(learner, cfg.steps - start, progress,
                                                          group_ids, start))
            rl_seconds = time.perf_counter() - rl_started
            if log.last_eval is not None and log.last_eval[0] == cfg.steps:
                after = log.last_eval[1]
            else:  # no step ran (resumed at the end)
                after = asyncio.run(evaluate(engine, cfg, tokenizer, new_env, step=cfg.steps))
        checkpoints.close()
        writer.close()
        # 4. The trained policy.
        final_dir = save_final_model(trainer, model, run.root / FINAL_MODEL_DIR)
    return {"solve_rate_before": before["solve_rate"], "solve_rate_after": after["solve_rate"],
            "eval_before": before, "eval_after": after, "steps": start + len(records),
            "resumed_from": start if resumed is not None else None,
            "train_reward_first": records[0].reward_mean if records else None,
            "train_reward_last": records[-1].reward_mean if records else None,
            "engine_busy_fraction": engine_busy_during(run.own / "perf") if owns_perf else None,
            "warmup_seconds": warmup_seconds, "rl_seconds": rl_seconds,
            "seconds": time.perf_counter() - started,
            "run_dir": str(run.root), "final_model": str(final_dir)}


class StepLog:
    """The learner's step hook: each step's metrics to metrics.jsonl/TensorBoard/W&B as it ends,
    held-out evaluation every `eval_every` steps (and after the last), checkpoints when due, at
    the end and on SIGTERM (then `RunStopped`)."""

    def __init__(self, cfg: AgenticRunConfig, learner: StreamingLearner | SyncLearner,
                 writer: MetricsWriter, checkpoints: LearnerCheckpoints,
                 guard: TerminationGuard, before: dict[str, float],
                 evaluate: Callable[..., Awaitable[dict[str, float]]]) -> None:
        self.cfg, self.learner, self.writer = cfg, learner, writer
        self.checkpoints, self.guard, self.before = checkpoints, guard, before
        self.evaluate = evaluate
        self.last_eval: tuple[int, dict[str, float]] | None = None
        self._dropped: collections.Counter[str] = collections.Counter()
        self._mark = (time.perf_counter(), perf.busy_seconds(perf.ENGINE))
        # Which groups each step trained (RUN_DIR/groups.jsonl), one history across resumes.
        self.groups_path = Path(writer.run_dir) / GROUPS_LOG
        truncate_jsonl(str(self.groups_path), learner.version)

    async def __call__(self, record: StepRecord) -> None:
        step, cfg = record.version + 1, self.cfg
        metrics = self.step_metrics(record)
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            figures = await self.evaluate(step=step)
            self.last_eval = (step, figures)
            metrics.update({f"eval/{k}": v for k, v in figures.items()})
        self.writer.write(step, metrics)
        self.writer.flush()  # on disk as the step ends, not one step later
        with self.groups_path.open("a") as f:
            f.write(json.dumps({"step": step, "groups": list(record.group_ids)}) + "\n")
        stop = self.guard.requested
        if self.checkpoints.should_save(step) or step == cfg.steps or stop:
            with perf.span(perf.TRAIN_CHECKPOINT, step=step):
                await asyncio.to_thread(self.checkpoints.save, step, self.learner.trainer,
                                        self.learner.cursor, data={"eval_before": self.before},
                                        force=step == cfg.steps or stop)
        if stop:
            await asyncio.to_thread(self.checkpoints.wait)
            raise RunStopped(f"stopped by SIGTERM after step {step} of {cfg.steps}; checkpoint "
                             f"written to {self.checkpoints.policy.cfg.directory}. Run the same "
                             "command again to resume")

    def step_metrics(self, record: StepRecord) -> dict[str, float]:
        """The step's scalars: reward and solve rate of its groups, staleness histogram, tokens,
        episode outcomes, groups dropped by cause, engine busy and trainer idle since the last
        step, and the trainer's loss terms (loss, KL, clip fraction, entropy, ...)."""
        now, busy = time.perf_counter(), perf.busy_seconds(perf.ENGINE)
        wall = max(now - self._mark[0], 1e-9)
        engine_busy = (busy - self._mark[1]) / wall
        self._mark = (now, busy)
        out: dict[str, float] = {
            "reward_mean": record.reward_mean, "solved": record.solved,
            "completion_tokens": record.completion_tokens,
            "staleness_max": float(max(record.staleness, default=0)),
            "data_wait_s": record.data_wait_s, "train_s": record.train_s,
            "weight_sync_s": record.sync_s, "engine_busy": engine_busy,
            "trainer_idle": min(record.data_wait_s / wall, 1.0)}
        for lag, n in collections.Counter(record.staleness).items():
            out[f"staleness/{lag}"] = float(n)
        for status, n in record.outcomes.items():
            out[f"episodes/{status}"] = float(n)
        queue = self.learner.queue
        if queue is not None:
            for reason, n in (queue.dropped - self._dropped).items():
                out[f"groups_dropped/{reason}"] = float(n)
            self._dropped = collections.Counter(queue.dropped)
        out.update({k: float(v) for k, v in record.metrics.items()
                    if isinstance(v, int | float)})
        stats = self.learner.engine.stats()
        for name in ("rerouted", "server_failures", "servers_up"):  # remote rollout servers
            if hasattr(stats, name):
                out[f"rollout/{name}"] = float(getattr(stats, name))
        return out


def save_final_model(trainer: PolicyTrainer, local_model: nnx.Module, directory: Path) -> Path:
    """The trained policy as a Hugging Face checkpoint (adapters merged), written by process 0.

    With several processes the trainer's arrays span every host: they are gathered (a
    collective) into `local_model`, this process's copy of the initial model, first."""
    final = trainer.model()
    if jax.process_count() > 1:
        nnx.update(local_model, distributed.fetch(nnx.state(final)))
        final = local_model
    if distributed.is_main_process():
        save_pretrained(merge_lora(final) if has_lora(final) else final, directory)
    distributed.barrier("agentic final model")
    return directory


__all__ = ["RL_PHASE", "AgenticRunConfig", "EnvSettings", "engine_busy_during", "env_backend",
           "run_agentic", "solve_rate", "train_with_progress"]
