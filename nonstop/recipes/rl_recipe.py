"""The single-turn RL recipe behind `nonstop rl`: a task, a model, an optional SFT warm-up on the
task's demonstrations, then RL with the algorithm chosen by name.

Single-turn RL is agentic RL with episodes of one model turn and no tool calls
(`agentic.single_turn`): it runs through the same orchestrator, group queue and
`StreamingLearner` as `nonstop agentic`. At `max_staleness: 0` (the default) every step collects
its groups with the current weights, trains, then pushes the weights: the synchronous learner's
steps, bit for bit. Group g answers the g-th example of the task's stream; episode i of group g
samples with a seed derived from (seed, g, i).

    cfg = load_config(RLRunConfig, "nonstop/recipes/configs/grpo_arithmetic.yaml", overrides)
    summary = run_rl(cfg)

The run directory gets `config.yaml`, `metrics.jsonl` (one line per step, eval rewards
included), TensorBoard scalars, the perf trace, and Orbax checkpoints; a run started again on the
same directory resumes from its last checkpoint and continues the same reward curve.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Literal

import jax
from jax.sharding import Mesh

from nonstop import perf
from nonstop.agentic.config import AgentConfig, OrchestratorConfig, StreamingLearnerConfig
from nonstop.agentic.config import RolloutConfig as RolloutBackendConfig
from nonstop.agentic.single_turn import ExampleStream, PromptEpisodes, PromptFormat, greedy_reward
from nonstop.agentic.streaming import (
    GroupCursor,
    StepRecord,
    StreamingLearner,
)
from nonstop.engine import EngineConfig, SamplingParams, gc_heap_frozen
from nonstop.engine.placement import PlacementConfig, place
from nonstop.models import Decoder, Tokenizer, load_pretrained, save_pretrained
from nonstop.models.lora import LoRAConfig, apply_lora
from nonstop.models.source import ModelSource, TokenizerSource, build_model, build_tokenizer
from nonstop.models.validation import check, check_int, check_ints
from nonstop.recipes.learner_state import (
    LearnerCheckpoints,
    RunStopped,
    TerminationGuard,
    resumed_group_ids,
)
from nonstop.recipes.run import RunDirs, start_run
from nonstop.recipes.tasks import ArithmeticTask, CountdownTask, Gsm8kTask, Task
from nonstop.recipes.tasks.custom import check_task_settings, custom_task
from nonstop.recipes.warmup import WarmupConfig, supervised_warmup
from nonstop.rl import RLAlgorithmConfig
from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
from nonstop.train import (
    CheckpointConfig,
    MetricsConfig,
    MetricsWriter,
    OptimizerConfig,
    PackingConfig,
    distributed,
)

AlgorithmName = Literal["grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "rloo", "ppo"]
TaskName = Literal["arithmetic", "countdown", "gsm8k", "custom"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSettings:
    name: TaskName = "arithmetic"
    digits: int = 2
    ops: tuple[str, ...] = ("+",)
    numbers: int = 3  # countdown
    path: str | None = None  # gsm8k: a local JSONL or Parquet file; custom: JSONL or module:fn
    # custom (recipes/tasks/custom.py): JSONL keys or the function's kwargs, a held-out file
    # (unset: a hash split holding out eval_fraction), the reward (unset: exact match)
    args: Any = None
    eval_path: str | None = None
    eval_fraction: float = 0.1
    reward: str | None = None  # "module:function" (prompt, completion, example) -> float
    num_eval: int = 128

    def __post_init__(self) -> None:
        check(self.name != "gsm8k" or bool(self.path), "TaskSettings", "path", self.path,
              "a local JSONL or Parquet file for name=gsm8k (task.path=/path/to/train.jsonl)")
        check_int("TaskSettings", "num_eval", self.num_eval)
        if self.name == "custom":
            check_task_settings(self, owner="TaskSettings")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig(RolloutBackendConfig):
    """G samples of each of `prompts_per_step` prompts (per process), each up to
    `max_new_tokens` tokens, drawn with `sampling`'s temperature, top-k and top-p (its
    `max_tokens`, stops and seed stay unset: the budget above, the tokenizer's end-of-sequence
    ids and per-episode seeds apply), on the engine `backend` names (local, vllm or remote;
    the fields it inherits are `nonstop agentic`'s `rollout:` section's)."""

    group_size: int = 8  # G
    prompts_per_step: int = 4
    max_new_tokens: int = 32
    sampling: SamplingParams = SamplingParams()
    prompt_format: PromptFormat = "raw"
    add_bos: bool = False

    RENAMED = {"temperature": "sampling.temperature", "top_k": "sampling.top_k",
               "top_p": "sampling.top_p"}

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = "RolloutConfig"
        check_int(owner, "group_size", self.group_size, low=2)  # group-relative advantages
        check_ints(owner, self, ("prompts_per_step", "max_new_tokens"))
        s = self.sampling
        check(s.max_tokens is None and s.seed is None and not s.stop_token_ids and not s.stop,
              owner, "sampling", s, "only temperature, top_k and top_p set")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLRunConfig:
    """Everything one `nonstop rl` run needs; the algorithm is chosen by name."""

    algorithm: AlgorithmName = "grpo"
    kl_coef: float | None = None  # None: the algorithm's default
    run_dir: str = "runs/rl"
    seed: int = 0
    steps: int = 60
    eval_every: int = 10
    model: ModelSource = ModelSource(family="qwen3")
    tokenizer: TokenizerSource = TokenizerSource(kind="char")
    lora: LoRAConfig | None = None
    task: TaskSettings = TaskSettings()
    warmup: WarmupConfig = WarmupConfig()
    rollout: RolloutConfig = RolloutConfig()
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=2e-4, schedule="constant",
                                                 weight_decay=0.0)
    critic_optimizer: OptimizerConfig | None = None  # ppo's value model; None: `optimizer`
    packing: PackingConfig = PackingConfig(buckets=(64, 128, 256, 512), rows_per_batch=16,
                                           max_segments_per_row=16)
    inner_epochs: int = 1
    # The learner: how far rollouts may run ahead of training (0: collect, train, push), how
    # often weights are pushed, how many episodes run at once (None: a step's worth per
    # version the rollouts may lead by).
    max_staleness: int = 0
    sync_every: int = 1
    max_concurrency: int | None = None
    # Groups the queue drops (flat rewards under dynamic sampling, failed rewards) are replaced
    # by new prompts; more than max_sampling_rounds x prompts_per_step drops while one step
    # collects stops the run (NoVarianceError).
    max_sampling_rounds: int = 4
    reward_on_error: Literal["skip", "zero", "raise"] = "skip"
    engine: EngineConfig = EngineConfig(max_slots=64, max_len=64)
    # Devices: one (the default), a colocated mesh shared by engine and trainer, or disjoint
    # engine and trainer sub-meshes (`mode: disaggregated`; weights are resharded across).
    placement: PlacementConfig = PlacementConfig()
    checkpoint: CheckpointConfig = CheckpointConfig(save_every=20, keep_last=3)

    # on_no_variance went with the batch learner's sampling rounds: past max_sampling_rounds
    # the run now always stops.
    RENAMED = {"on_no_variance": "max_sampling_rounds"}

    def __post_init__(self) -> None:
        check_int("RLRunConfig", "max_sampling_rounds", self.max_sampling_rounds, low=0)
        check(self.max_concurrency is None or self.max_concurrency >= 1, "RLRunConfig",
              "max_concurrency", self.max_concurrency, "null or an int >= 1")
        self.learner_config()  # validates max_staleness and sync_every

    def learner_config(self, stop_token_ids: tuple[int, ...] = (), processes: int = 1
                       ) -> StreamingLearnerConfig:
        """The streaming learner's settings; `rollout.prompts_per_step` is per process."""
        r = self.rollout
        groups = r.prompts_per_step * processes
        agent = AgentConfig(max_turns=1, max_tokens_per_turn=r.max_new_tokens,
                            max_episode_tokens=r.max_new_tokens, step_timeout_s=None,
                            sampling=dataclasses.replace(r.sampling,
                                                         stop_token_ids=stop_token_ids))
        concurrency = self.max_concurrency or (self.max_staleness + 1) * r.prompts_per_step * \
            r.group_size
        return StreamingLearnerConfig(
            groups_per_step=groups, max_staleness=self.max_staleness, sync_every=self.sync_every,
            max_dropped_groups_per_step=self.max_sampling_rounds * groups,
            orchestrator=OrchestratorConfig(group_size=r.group_size, max_concurrency=concurrency,
                                            seed=self.seed, agent=agent))

    def algorithm_config(self) -> RLAlgorithmConfig:
        """The named preset, its length constants set from `rollout.max_new_tokens`."""
        return RLAlgorithmConfig.for_run(self.algorithm, budget=self.rollout.max_new_tokens,
                                         kl_coef=self.kl_coef)


def multi_host_mesh(placement: PlacementConfig) -> Mesh:
    """The trainer's global mesh under `jax.distributed`: `placement.trainer`'s shape when it
    covers every device, else fsdp over all of them. Engines stay on each host's devices."""
    if placement.mode == "disaggregated":
        raise ValueError("placement.mode=disaggregated splits one process's devices; with several "
                         "processes each host runs its own engine and the trainer spans all hosts"
                         " (leave placement at its default)")
    shape = placement.trainer
    if shape.num_devices == jax.device_count():
        return distributed.global_mesh(data=shape.data, fsdp=shape.fsdp, tp=shape.tp)
    return distributed.global_mesh(fsdp=jax.device_count())


def build_task(cfg: TaskSettings) -> Task:
    if cfg.name == "arithmetic":
        return ArithmeticTask(digits=cfg.digits, ops=cfg.ops)
    if cfg.name == "countdown":
        return CountdownTask(numbers=cfg.numbers)
    if cfg.name == "custom":
        return custom_task(cfg)
    return Gsm8kTask.from_file(cfg.path)


def initial_policy(cfg: RLRunConfig, run: RunDirs, tokenizer: Tokenizer, task: Task,
                   resuming: bool) -> Decoder:
    """The policy RL starts from (the KL reference and the critic's starting point): the
    configured model, SFT-warmed on the task's demonstrations if `warmup.steps`, with LoRA
    adapters if `lora`. The warmed-up model is kept in RUN_DIR/warmup_model, so a resumed run
    rebuilds the same policy instead of a random one."""
    model = build_model(cfg.model, tokenizer, seed=cfg.seed)
    warm_dir = run.root / "warmup_model"
    if cfg.warmup.steps and resuming and (warm_dir / "config.json").exists():
        model = load_pretrained(warm_dir)
    elif cfg.warmup.steps and not resuming:
        model = supervised_warmup(model, tokenizer, task, cfg.warmup, seed=cfg.seed)
        if distributed.is_main_process():
            save_pretrained(model, warm_dir)
        distributed.barrier("warmup_model")
    return apply_lora(model, cfg.lora, seed=cfg.seed) if cfg.lora is not None else model


def meshes(placement: PlacementConfig) -> tuple[Mesh | None, Mesh | None]:
    """(engine mesh, trainer mesh): None for one device; the global trainer mesh under several
    processes (each host's engine stays on its own devices); else `placement`'s two meshes."""
    if jax.process_count() > 1:
        return None, multi_host_mesh(placement)
    if placement == PlacementConfig():
        return None, None
    placed = place(placement)
    return placed.engine_mesh, placed.trainer_mesh


def run_rl(cfg: RLRunConfig, *, progress: bool = True) -> dict[str, Any]:
    """Train; returns the eval reward before and after RL and the per-step history.

    Under `jax.distributed` every process runs this: each rolls out its own block of each step's
    groups on its own engine, the trainer steps on the global batch, process 0 writes the
    shared files."""
    # 1. The run directory, the task and the tokenizer.
    run = start_run(cfg, cfg.run_dir)
    task = build_task(cfg.task)
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    eval_examples = task.eval_examples(cfg.task.num_eval, seed=cfg.seed + 1)
    with perf.run(run.own / "perf"):
        # 2. The initial policy, the devices, the trainer and its checkpoints.
        checkpoints = LearnerCheckpoints.open(cfg.checkpoint, run,
                                              cfg.algorithm_config().value is not None)
        resuming = checkpoints.policy.latest_step() is not None
        model = initial_policy(cfg, run, tokenizer, task, resuming)
        engine_mesh, trainer_mesh = meshes(cfg.placement)
        trainer = PolicyTrainer(model, PolicyTrainerConfig(
            algorithm=cfg.algorithm_config(), optimizer=cfg.optimizer, packing=cfg.packing,
            inner_epochs=cfg.inner_epochs, lora_only=cfg.lora is not None,
            critic_optimizer=cfg.critic_optimizer, seed=cfg.seed), mesh=trainer_mesh)
        # 3. Resume: the train state and the position in the prompt stream (group g answers
        # the stream's g-th example).
        resumed = checkpoints.restore(trainer, run)
        start_step = resumed.step if resumed is not None else 0
        cursor = resumed.cursor if resumed is not None else GroupCursor()
        processes = jax.process_count()
        learner_cfg = cfg.learner_config(tuple(tokenizer.eos_ids), processes)
        examples = ExampleStream(task.iter_examples("train", cfg.seed))
        episodes = PromptEpisodes(tokenizer, examples, task.reward,
                                  prompt_format=cfg.rollout.prompt_format,
                                  add_bos=cfg.rollout.add_bos,
                                  reward_on_error=cfg.reward_on_error)
        writer = MetricsWriter(run.own, MetricsConfig(progress_bar=progress),
                               total_steps=cfg.steps, resume_step=start_step or None)

        # 4. The engine and the learner: evaluate, train (evaluating every eval_every steps and
        # checkpointing after each step's weights are pushed), evaluate.
        started = time.perf_counter()
        # Several processes: each host's engine holds a local copy (the trainer's arrays span
        # every host); it starts from the initial model and takes the trainer's weights.
        engine_model = trainer.model() if processes == 1 else model
        with cfg.rollout.build(engine_model, cfg.engine, tokenizer=tokenizer,
                               policy_version=start_step, mesh=engine_mesh) as engine:
            if processes > 1 and start_step:
                engine.update_weights(distributed.fetch(trainer.policy_params()), start_step)
            distributed.barrier("rollout weights published")  # shared servers: by process 0

            async def evaluate(step: int) -> float:
                return await greedy_reward(
                    engine, tokenizer, eval_examples, task.reward,
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    prompt_format=cfg.rollout.prompt_format, add_bos=cfg.rollout.add_bos,
                    step=step)

            history: list[dict[str, Any]] = []
            dropped_before: dict[str, int] = {}

            async def on_step(record: StepRecord) -> None:
                step = record.version + 1
                dropped = dict(learner.queue.dropped) if learner.queue is not None else {}
                metrics: dict[str, Any] = {
                    "step": record.version, "groups_kept": len(record.group_ids),
                    "groups_dropped_no_variance": dropped.get("no_reward_variance", 0)
                    - dropped_before.get("no_reward_variance", 0),
                    "groups_dropped_failed": dropped.get("episode_failed", 0)
                    - dropped_before.get("episode_failed", 0),
                    "reward_mean": record.reward_mean,
                    "completion_tokens": record.completion_tokens,
                    "staleness_max": max(record.staleness, default=0), **record.metrics}
                dropped_before.update(dropped)
                every = cfg.eval_every
                if (every and step % every == 0) or step == cfg.steps:
                    metrics["eval_reward"] = await evaluate(step)
                history.append(metrics)
                writer.write(step, {k: v for k, v in metrics.items()
                                    if isinstance(v, int | float) and k != "step"})
                stop = guard.requested
                if checkpoints.should_save(step) or step == cfg.steps or stop:
                    writer.flush()
                    position = learner.cursor
                    if processes > 1:  # every process's position: resume past all of them
                        position = GroupCursor((), await asyncio.to_thread(
                            distributed.max_over_processes, position.next))
                    with perf.span(perf.TRAIN_CHECKPOINT, step=step):
                        await asyncio.to_thread(checkpoints.save, step, trainer, position,
                                                data={"eval_before": history[0]["eval_reward"]},
                                                force=step == cfg.steps or stop)
                if stop:
                    await asyncio.to_thread(checkpoints.wait)
                    raise RunStopped(f"stopped by SIGTERM after step {step} of {cfg.steps}; "
                                     f"checkpoint written to {checkpoints.policy.cfg.directory}."
                                     " Run the same command again to resume")

            learner = StreamingLearner(trainer, engine, episodes, learner_cfg, on_step=on_step)

            async def main() -> float:
                # A resumed run reports the first run's starting figure as its "before".
                before = (resumed.data["eval_before"] if resumed is not None
                          and "eval_before" in resumed.data else await evaluate(start_step))
                history.append({"step": start_step, "eval_reward": before})
                group_ids = resumed_group_ids(cursor, learner_cfg.groups_per_step)
                await episodes.watch(asyncio.ensure_future(
                    learner.run(cfg.steps - start_step, group_ids)))
                return before

            with gc_heap_frozen(), TerminationGuard() as guard:
                before = asyncio.run(main())
        # 5. Close: the last checkpoint written, the metrics flushed.
        checkpoints.close()
        writer.close()
    evals = [h["eval_reward"] for h in history[1:] if "eval_reward" in h]
    return {"eval_before": before, "eval_after": evals[-1] if evals else before,
            "history": history, "seconds": time.perf_counter() - started,
            "failures": dict(episodes.failures), "run_dir": str(run.root)}


__all__ = ["RLRunConfig", "RolloutConfig", "TaskSettings", "build_task", "initial_policy", "meshes",
           "run_rl"]
