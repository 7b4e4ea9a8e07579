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
from pathlib import Path
from typing import Any, Literal

import jax
import yaml
from jax.sharding import Mesh

from nonstop import perf
from nonstop.engine import Engine, gc_heap_frozen
from nonstop.engine.placement import PlacementConfig, place
from nonstop.models import (
    ModelConfig,
    Tokenizer,
    init_decoder,
    load_pretrained,
    save_pretrained,
)
from nonstop.models.lora import LoRAConfig, apply_lora
from nonstop.recipes.char_tokenizer import char_tokenizer
from nonstop.recipes.config_io import dump_config
from nonstop.recipes.tasks import ArithmeticTask, CountdownTask, Gsm8kTask, Task
from nonstop.recipes.warmup import WarmupConfig, supervised_warmup
from nonstop.rl import RLAlgorithmConfig
from nonstop.rl.learner import Learner, LearnerConfig, RolloutConfig
from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
from nonstop.rl.rewards import Example
from nonstop.sft.config import CheckpointSettings, ModelSource, TokenizerSource
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
        if self.name == "gsm8k" and not self.path:
            raise ValueError("task.name=gsm8k needs task.path=/path/to/train.jsonl (or .parquet)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """The rollout engine's size; `decode_buckets` > 1 and `prefill_rows` > 1 trade bit-exact
    reproducibility for faster decode of short sequences and fewer prefill calls when many
    turns start at once; `decode_steps_per_call` > 1 runs several decode steps per device call
    (less host work a token, some steps computed past a request's end); `pipeline_depth` 3
    lets the device run two steps ahead of the host's bookkeeping; `swap_space_gib`:
    host memory for evicted sessions' KV caches (0: an evicted episode re-prefills its
    context). See `EngineConfig`."""

    max_slots: int = 64
    max_len: int = 64
    decode_buckets: int = 1
    prefill_rows: int = 1
    decode_steps_per_call: int = 1
    pipeline_depth: int = 2
    swap_space_gib: float = 0.0

    def engine_kwargs(self) -> dict[str, Any]:
        """These settings as `Engine` keywords (each is an `EngineConfig` field)."""
        return dataclasses.asdict(self)


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
    engine: EngineSettings = EngineSettings()
    # Devices: one (the default), a colocated mesh shared by engine and trainer, or disjoint
    # engine and trainer sub-meshes (`mode: disaggregated`; weights are resharded across).
    placement: PlacementConfig = PlacementConfig()
    checkpoint: CheckpointSettings = CheckpointSettings(save_every=20)

    def algorithm_config(self) -> RLAlgorithmConfig:
        """The named preset, with its length constants set from this run's generation budget:
        Dr.GRPO's constant normaliser and DAPO's overlong limit are `rollout.max_new_tokens`
        (the papers' values assume budgets of thousands of tokens), DAPO's soft-punishment
        buffer is a fifth of it (4096 of 20480 in the paper)."""
        budget = self.rollout.max_new_tokens
        if self.algorithm == "dr_grpo":
            algorithm = RLAlgorithmConfig.dr_grpo(max_len_norm=budget)
        elif self.algorithm == "dapo":
            algorithm = RLAlgorithmConfig.dapo(max_response_tokens=budget,
                                               buffer_tokens=max(1, budget // 5))
        else:
            algorithm = getattr(RLAlgorithmConfig, self.algorithm)()
        if self.kl_coef is not None:
            kl = dataclasses.replace(algorithm.policy_loss.kl, coef=self.kl_coef)
            algorithm = dataclasses.replace(
                algorithm, policy_loss=dataclasses.replace(algorithm.policy_loss, kl=kl))
        return algorithm


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


def build_tokenizer(source: TokenizerSource, model: ModelSource) -> Tokenizer:
    """The char tokenizer, or a local tokenizer directory (default: the model checkpoint's)."""
    if source.kind == "char":
        return char_tokenizer(source.chat_format)
    path = source.path or model.path
    if path is None:
        raise ValueError("tokenizer.kind=pretrained needs tokenizer.path or model.path")
    return Tokenizer.from_pretrained(path)


def build_model(source: ModelSource, tokenizer: Tokenizer, *, seed: int = 0):
    """A local checkpoint, or a preset / tiny config with random weights sized to the tokenizer."""
    if source.kind == "checkpoint":
        model = load_pretrained(source.path)
    else:
        special = dict(bos_token_id=tokenizer.bos_id, eos_token_ids=tokenizer.eos_ids,
                       pad_token_id=tokenizer.pad_id)
        if source.kind == "preset":
            model_cfg = ModelConfig.preset(source.preset).replace(**source.tiny_overrides())
        else:
            model_cfg = ModelConfig.tiny(source.family, **{"vocab_size": tokenizer.vocab_size,
                                                           **special, **source.tiny_overrides()})
        model = init_decoder(model_cfg, seed=seed)
    if model.cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"the model's vocab_size ({model.cfg.vocab_size}) is smaller than the "
                         f"tokenizer's ({tokenizer.vocab_size})")
    return model


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


def run_rl(cfg: RLRunConfig, *, progress: bool = True) -> dict[str, Any]:
    """Train; returns the eval reward before and after RL and the per-step history."""
    # Under `jax.distributed` (NONSTOP_COORDINATOR_ADDRESS etc., see docs/scaling.md) every
    # process runs this: each rolls out its own block of each step's prompts on its own engine,
    # and the trainer steps on the global batch; process 0 writes the shared files.
    distributed.initialize(distributed.DistributedConfig.from_env())
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    own_dir = Path(distributed.process_run_dir(str(run_dir)))
    own_dir.mkdir(parents=True, exist_ok=True)
    if distributed.is_main_process():
        (run_dir / "config.yaml").write_text(yaml.safe_dump(dump_config(cfg), sort_keys=False))
    task = build_task(cfg.task)
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    eval_examples = task.eval_examples(cfg.task.num_eval, seed=cfg.seed + 1)
    with perf.run(own_dir / "perf"):
        model = build_model(cfg.model, tokenizer, seed=cfg.seed)
        checkpointer = Checkpointer(CheckpointConfig(
            directory=str(run_dir / "checkpoints"), save_every=cfg.checkpoint.save_every,
            keep_last=cfg.checkpoint.keep_last, async_save=cfg.checkpoint.async_save))
        resuming = checkpointer.latest_step() is not None
        # The warmed-up model is kept: a resumed run rebuilds the same initial policy (the KL
        # reference and the critic's starting point) instead of a random one.
        warm_dir = run_dir / "warmup_model"
        if cfg.warmup.steps and resuming and (warm_dir / "config.json").exists():
            model = load_pretrained(warm_dir)
        elif cfg.warmup.steps and not resuming:
            model = supervised_warmup(model, tokenizer, task, cfg.warmup, seed=cfg.seed)
            if distributed.is_main_process():
                save_pretrained(model, warm_dir)
            distributed.barrier("warmup_model")
        if cfg.lora is not None:
            model = apply_lora(model, cfg.lora, seed=cfg.seed)
        engine_mesh = trainer_mesh = None
        processes = jax.process_count()
        if processes > 1:
            trainer_mesh = multi_host_mesh(cfg.placement)
        elif cfg.placement != PlacementConfig():
            placement = place(cfg.placement)
            engine_mesh, trainer_mesh = placement.engine_mesh, placement.trainer_mesh
        trainer = PolicyTrainer(model, PolicyTrainerConfig(
            algorithm=cfg.algorithm_config(), optimizer=cfg.optimizer, packing=cfg.packing,
            inner_epochs=cfg.inner_epochs, lora_only=cfg.lora is not None,
            critic_optimizer=cfg.critic_optimizer, seed=cfg.seed), mesh=trainer_mesh)
        critic_checkpointer = None
        if trainer.critic is not None:
            critic_checkpointer = Checkpointer(CheckpointConfig(
                directory=str(run_dir / "critic_checkpoints"),
                save_every=cfg.checkpoint.save_every, keep_last=cfg.checkpoint.keep_last,
                async_save=cfg.checkpoint.async_save))
        start_step, consumed = 0, 0
        if resuming:
            restored = checkpointer.restore(trainer.state)
            trainer.state = restored.state
            start_step = int(restored.step)
            consumed = int(restored.data_state["examples_consumed"])
            if critic_checkpointer is not None:
                if start_step not in critic_checkpointer.all_steps():
                    raise FileNotFoundError(
                        f"{run_dir}: policy checkpoint at step {start_step} but no critic "
                        f"checkpoint in {run_dir / 'critic_checkpoints'}; cannot resume PPO")
                critic = critic_checkpointer.restore(trainer.critic.state, step=start_step)
                trainer.critic.state = critic.state
        examples = CountingIterator(task.iter_examples("train", cfg.seed), skip=consumed)
        writer = MetricsWriter(own_dir, MetricsConfig(progress_bar=progress),
                               total_steps=cfg.steps, resume_step=start_step or None)
        learner_cfg = LearnerConfig(rollout=cfg.rollout, steps=cfg.steps,
                                    eval_every=cfg.eval_every,
                                    max_sampling_rounds=cfg.max_sampling_rounds,
                                    on_no_variance=cfg.on_no_variance,
                                    reward_on_error=cfg.reward_on_error, seed=cfg.seed)

        def on_step(step: int, metrics: dict[str, Any]) -> None:
            writer.write(step, {k: v for k, v in metrics.items()
                                if isinstance(v, int | float) and k != "step"})
            if checkpointer.should_save(step) or step == cfg.steps:
                writer.flush()
                with perf.span(perf.TRAIN_CHECKPOINT, step=step):
                    checkpointer.save(step, trainer.state,
                                      data_state={"examples_consumed": examples.consumed})
                    if critic_checkpointer is not None:
                        critic_checkpointer.save(step, trainer.critic.state,
                                                 data_state={"examples_consumed":
                                                             examples.consumed})

        started = time.perf_counter()
        # Several processes: each host's engine holds a local copy (the trainer's arrays span
        # every host); it starts from the initial model and takes the trainer's weights.
        engine_model = trainer.model() if processes == 1 else model
        with Engine(engine_model, **cfg.engine.engine_kwargs(), tokenizer=tokenizer,
                    policy_version=start_step, mesh=engine_mesh) as engine:
            if processes > 1 and start_step:
                engine.update_weights(distributed.fetch(trainer.policy_params()), start_step)
            learner = Learner(trainer, engine, tokenizer, examples, task.reward, learner_cfg,
                              on_step=on_step)
            learner.step = start_step
            before = asyncio.run(learner.evaluate(eval_examples))
            with gc_heap_frozen():
                history = asyncio.run(learner.run(eval_examples))
        for ckpt in (checkpointer, critic_checkpointer):
            if ckpt is not None:
                ckpt.wait()
                ckpt.close()
        writer.close()
    evals = [h["eval_reward"] for h in history if "eval_reward" in h]
    return {"eval_before": before, "eval_after": evals[-1] if evals else before,
            "history": history, "seconds": time.perf_counter() - started,
            "failures": learner.failures, "run_dir": str(run_dir)}


__all__ = ["EngineSettings", "RLRunConfig", "TaskSettings", "build_task", "run_rl"]
