"""The single-turn RL recipe behind `nonstop rl`: a task, a model, an optional SFT warm-up on the
task's demonstrations, then the batch learner with the algorithm chosen by name.

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
from collections.abc import Iterator
from typing import Any, Literal

import jax
from jax.sharding import Mesh

from nonstop import perf
from nonstop.engine import Engine, EngineConfig, gc_heap_frozen
from nonstop.engine.placement import PlacementConfig, place
from nonstop.models import Decoder, Tokenizer, load_pretrained, save_pretrained
from nonstop.models.lora import LoRAConfig, apply_lora
from nonstop.models.source import ModelSource, TokenizerSource, build_model, build_tokenizer
from nonstop.models.validation import check, check_int
from nonstop.recipes.run import RunDirs, start_run
from nonstop.recipes.tasks import ArithmeticTask, CountdownTask, Gsm8kTask, Task
from nonstop.recipes.warmup import WarmupConfig, supervised_warmup
from nonstop.rl import RLAlgorithmConfig
from nonstop.rl.learner import BatchLearnerConfig, Learner, RolloutConfig
from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
from nonstop.rl.rewards import Example
from nonstop.train import (
    CheckpointConfig,
    Checkpointer,
    MetricsConfig,
    MetricsWriter,
    OptimizerConfig,
    PackingConfig,
    distributed,
)

AlgorithmName = Literal["grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "rloo", "ppo"]
TaskName = Literal["arithmetic", "countdown", "gsm8k"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSettings:
    name: TaskName = "arithmetic"
    digits: int = 2
    ops: tuple[str, ...] = ("+",)
    numbers: int = 3  # countdown
    path: str | None = None  # gsm8k: a local JSONL or Parquet file
    num_eval: int = 128

    def __post_init__(self) -> None:
        check(self.name != "gsm8k" or bool(self.path), "TaskSettings", "path", self.path,
              "a local JSONL or Parquet file for name=gsm8k (task.path=/path/to/train.jsonl)")
        check_int("TaskSettings", "num_eval", self.num_eval)


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
    max_sampling_rounds: int = 4
    on_no_variance: Literal["skip", "stop"] = "skip"
    reward_on_error: Literal["skip", "zero", "raise"] = "skip"
    engine: EngineConfig = EngineConfig(max_slots=64, max_len=64)
    # Devices: one (the default), a colocated mesh shared by engine and trainer, or disjoint
    # engine and trainer sub-meshes (`mode: disaggregated`; weights are resharded across).
    placement: PlacementConfig = PlacementConfig()
    checkpoint: CheckpointConfig = CheckpointConfig(save_every=20, keep_last=3)

    def learner_config(self) -> BatchLearnerConfig:
        return BatchLearnerConfig(rollout=self.rollout, steps=self.steps,
                                  eval_every=self.eval_every,
                                  max_sampling_rounds=self.max_sampling_rounds,
                                  on_no_variance=self.on_no_variance,
                                  reward_on_error=self.reward_on_error, seed=self.seed)

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
    return Gsm8kTask.from_file(cfg.path)


class CountingIterator:
    """An example stream that knows how many examples it has handed out (for resume)."""

    def __init__(self, it: Iterator[Example], skip: int = 0) -> None:
        self._it = it
        self.consumed = 0
        for _ in range(skip):
            next(self)

    def __iter__(self) -> CountingIterator:
        return self

    def __next__(self) -> Example:
        self.consumed += 1
        return next(self._it)


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


@dataclasses.dataclass
class RLCheckpoints:
    """The policy's checkpoints (RUN_DIR/checkpoints) and, for PPO, the critic's."""

    policy: Checkpointer
    critic: Checkpointer | None

    @classmethod
    def open(cls, cfg: CheckpointConfig, run: RunDirs, with_critic: bool) -> RLCheckpoints:
        critic = Checkpointer(cfg.in_run(run.root, "critic_checkpoints")) if with_critic else None
        return cls(Checkpointer(cfg.in_run(run.root)), critic)

    def restore(self, trainer: PolicyTrainer, run: RunDirs) -> tuple[int, int]:
        """Restore the trainer in place; (step, examples consumed), (0, 0) on a fresh run."""
        restored = self.policy.restore(trainer.state)
        if restored is None:
            return 0, 0
        trainer.state = restored.state
        step = int(restored.step)
        if self.critic is not None:
            if step not in self.critic.all_steps():
                raise FileNotFoundError(
                    f"{run.root}: policy checkpoint at step {step} but no critic checkpoint in "
                    f"{self.critic.cfg.directory}; cannot resume PPO")
            trainer.critic.state = self.critic.restore(trainer.critic.state, step=step).state
        return step, int(restored.data_state["examples_consumed"])

    def save(self, step: int, trainer: PolicyTrainer, consumed: int, *, force: bool) -> None:
        """Save if `step` is due (or `force`: the run's last step)."""
        data = {"examples_consumed": consumed}
        self.policy.save(step, trainer.state, data_state=data, force=force)
        if self.critic is not None:
            self.critic.save(step, trainer.critic.state, data_state=data, force=force)

    def close(self) -> None:
        for ckpt in (self.policy, self.critic):
            if ckpt is not None:
                ckpt.wait()
                ckpt.close()


def run_rl(cfg: RLRunConfig, *, progress: bool = True) -> dict[str, Any]:
    """Train; returns the eval reward before and after RL and the per-step history.

    Under `jax.distributed` every process runs this: each rolls out its own block of each step's
    prompts on its own engine, the trainer steps on the global batch, process 0 writes the
    shared files."""
    # 1. The run directory, the task and the tokenizer.
    run = start_run(cfg, cfg.run_dir)
    task = build_task(cfg.task)
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    eval_examples = task.eval_examples(cfg.task.num_eval, seed=cfg.seed + 1)
    with perf.run(run.own / "perf"):
        # 2. The initial policy, the devices, the trainer and its checkpoints.
        checkpoints = RLCheckpoints.open(cfg.checkpoint, run,
                                         cfg.algorithm_config().value is not None)
        resuming = checkpoints.policy.latest_step() is not None
        model = initial_policy(cfg, run, tokenizer, task, resuming)
        engine_mesh, trainer_mesh = meshes(cfg.placement)
        trainer = PolicyTrainer(model, PolicyTrainerConfig(
            algorithm=cfg.algorithm_config(), optimizer=cfg.optimizer, packing=cfg.packing,
            inner_epochs=cfg.inner_epochs, lora_only=cfg.lora is not None,
            critic_optimizer=cfg.critic_optimizer, seed=cfg.seed), mesh=trainer_mesh)
        # 3. Resume: the train state and the position in the prompt stream.
        start_step, consumed = checkpoints.restore(trainer, run)
        examples = CountingIterator(task.iter_examples("train", cfg.seed), skip=consumed)
        writer = MetricsWriter(run.own, MetricsConfig(progress_bar=progress),
                               total_steps=cfg.steps, resume_step=start_step or None)

        def on_step(step: int, metrics: dict[str, Any]) -> None:
            writer.write(step, {k: v for k, v in metrics.items()
                                if isinstance(v, int | float) and k != "step"})
            if checkpoints.policy.should_save(step) or step == cfg.steps:
                writer.flush()
                with perf.span(perf.TRAIN_CHECKPOINT, step=step):
                    checkpoints.save(step, trainer, examples.consumed, force=step == cfg.steps)

        # 4. The engine and the learner: evaluate, train, evaluate.
        started = time.perf_counter()
        processes = jax.process_count()
        # Several processes: each host's engine holds a local copy (the trainer's arrays span
        # every host); it starts from the initial model and takes the trainer's weights.
        engine_model = trainer.model() if processes == 1 else model
        with Engine(engine_model, cfg.engine, tokenizer=tokenizer, policy_version=start_step,
                    mesh=engine_mesh) as engine:
            if processes > 1 and start_step:
                engine.update_weights(distributed.fetch(trainer.policy_params()), start_step)
            learner = Learner(trainer, engine, tokenizer, examples, task.reward,
                              cfg.learner_config(), on_step=on_step)
            learner.step = start_step
            before = asyncio.run(learner.evaluate(eval_examples))
            with gc_heap_frozen():
                history = asyncio.run(learner.run(eval_examples))
        # 5. Close: the last checkpoint written, the metrics flushed.
        checkpoints.close()
        writer.close()
    evals = [h["eval_reward"] for h in history if "eval_reward" in h]
    return {"eval_before": before, "eval_after": evals[-1] if evals else before,
            "history": history, "seconds": time.perf_counter() - started,
            "failures": learner.failures, "run_dir": str(run.root)}


__all__ = ["RLRunConfig", "TaskSettings", "build_task", "initial_policy", "meshes", "run_rl"]
