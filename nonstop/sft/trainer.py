"""The supervised trainer behind `nonstop sft · dpo · orpo`: build, resume, step, checkpoint, export.

    cfg, tokenizer = nonstop.recipes.sft_data.prepare_run(load_config(SFTRunConfig, path, overrides))
    result = train(cfg, tokenizer=tokenizer)

`train` is the whole run, read top to bottom:
1. tokenizer and model — a local checkpoint, a preset or a tiny config with random weights; QLoRA
   quantizes the base, then LoRA wraps the projections (only adapters train and are saved);
2. the mesh and the `TrainState` (float32 master copy of the trainable weights, bf16 compute
   when `dtype=bfloat16`), sharded by the model's logical axes; for precomputed DPO, one pass of
   the frozen reference over the data (cached in the run directory, written by process 0 when
   several processes run it together);
3. the Grain pipeline of packed batches from a few fixed length buckets, and the one jitted,
   donated step (`make_train_step`) with gradient accumulation;
4. resume from the last complete checkpoint (params, optimizer state, step, RNG and the data
   iterator's position), then the loop — data wait, step, metrics, periodic async checkpoint —
   recorded through `nonstop.perf`;
5. a final checkpoint and the export: adapters merged into the base, `save_pretrained` (plus the
   tokenizer) into RUN_DIR/export.

Metrics per step (JSONL, TensorBoard, progress bar): loss, learning_rate, grad_norm, tokens
(real tokens in the batch) and tokens_per_second, fill_ratio, truncated_tokens, the loss's own
denominator (`loss_tokens` for SFT and ORPO, `pairs` for DPO), and the DPO / ORPO metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from nonstop import perf
from nonstop.models.checkpoint import save_pretrained
from nonstop.models.lora import apply_lora, has_lora, merge_lora
from nonstop.models.peft_format import save_adapters
from nonstop.models.quantize import PROJECTIONS, QuantizedWeight, quantize_model
from nonstop.models.source import build_model, build_tokenizer
from nonstop.models.tokenizer import Tokenizer
from nonstop.sft import reference as ref_cache
from nonstop.sft.config import SFTRunConfig
from nonstop.sft.preference import (
    POLICY,
    PolicyWithReference,
    dpo_loss_fn,
    forward_logprobs,
    orpo_loss_fn,
    policy_of,
    reference_of,
    sft_loss_fn,
)
from nonstop.train import distributed
from nonstop.train.batch import TrainBatch
from nonstop.train.checkpoint import Checkpointer
from nonstop.train.metrics import MetricsWriter
from nonstop.train.optim import build_optimizer
from nonstop.train.state import TrainState
from nonstop.train.step import LossFn, StepSetup, setup_train_step

EXPORT_DIR = "export"
ADAPTERS_DIR = "adapters"
CHECKPOINT_DIR = "checkpoints"


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What a finished `train` call did."""

    run_dir: str
    start_step: int  # 0, or the checkpoint step it resumed from
    last_step: int  # the last step taken (less than cfg.steps if the data ran out)
    last_metrics: dict[str, float] | None
    export_dir: str | None
    state: TrainState


def load_tokenizer(cfg: SFTRunConfig, tokenizer: Tokenizer | None = None) -> Tokenizer:
    """`tokenizer` if given, else the one `cfg.tokenizer` names."""
    return tokenizer if tokenizer is not None else build_tokenizer(cfg.tokenizer, cfg.model)


def compute_dtype(cfg: SFTRunConfig) -> jnp.dtype:
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


def build_mesh(cfg: SFTRunConfig) -> Mesh | None:
    """The (data, fsdp, tp) mesh of `cfg.mesh` (`distributed.trainer_mesh`); None: one device."""
    return distributed.trainer_mesh(data=cfg.mesh.data, fsdp=cfg.mesh.fsdp, tp=cfg.mesh.tp)


def build_train_model(cfg: SFTRunConfig, tokenizer: Tokenizer, mesh: Mesh | None = None
                      ) -> nnx.Module:
    """The model to train: base weights, then quantization and LoRA adapters if configured."""
    dtype = compute_dtype(cfg)
    full = cfg.lora is None
    # Full fine-tuning keeps a float32 master copy anyway; a frozen base stays in `dtype`.
    model = build_model(cfg.model, tokenizer, seed=cfg.seed, dtype=dtype,
                        param_dtype=jnp.float32 if full else dtype, mesh=mesh)
    if cfg.quantization is not None:
        model = quantize_model(model, cfg.quantization)
    if cfg.lora is not None:
        model = apply_lora(model, cfg.lora, seed=cfg.seed)
    if full and _needs_reference_copy(cfg):
        model = PolicyWithReference(model)
    return model


def _needs_reference_copy(cfg: SFTRunConfig) -> bool:
    return cfg.algorithm == "dpo" and not cfg.dpo.reference_free and cfg.reference == "on_the_fly"


def _uses_precomputed_reference(cfg: SFTRunConfig) -> bool:
    return cfg.algorithm == "dpo" and not cfg.dpo.reference_free and cfg.reference == "precomputed"


def trainable_filter(cfg: SFTRunConfig) -> nnx.filterlib.Filter:
    if cfg.lora is not None:
        return nnx.LoRAParam
    if _needs_reference_copy(cfg):
        return nnx.All(nnx.Param, nnx.PathContains(POLICY))
    return nnx.Param


def make_loss_fn(cfg: SFTRunConfig) -> LossFn:
    dropout = cfg.lora is not None and cfg.lora.dropout > 0
    segments = cfg.packing.max_segments_per_row
    if cfg.algorithm == "dpo":
        return dpo_loss_fn(cfg.dpo, reference=cfg.reference, num_segments=segments,
                           dropout=dropout)
    if cfg.algorithm == "orpo":
        return orpo_loss_fn(cfg.orpo, num_segments=segments, dropout=dropout)
    return sft_loss_fn(dropout=dropout)


def setup_step(cfg: SFTRunConfig, state: TrainState, mesh: Mesh | None) -> StepSetup:
    """The jitted step for `cfg` and the state placed on `mesh` (unchanged without one)."""
    return setup_train_step(state, make_loss_fn(cfg), cfg.optimizer,
                            grad_accum_steps=cfg.grad_accum_steps, mesh=mesh)


def create_state(cfg: SFTRunConfig, model: nnx.Module) -> TrainState:
    return TrainState.create(model, build_optimizer(cfg.optimizer), rng=jax.random.key(cfg.seed),
                             wrt=trainable_filter(cfg))


def reference_cache(cfg: SFTRunConfig, model: nnx.Module, tokenizer: Tokenizer,
                    batch_sharding: NamedSharding | None) -> dict[str, tuple[np.ndarray, ...]]:
    """Reference log-probs of every example, from RUN_DIR's cache or one pass over the data.

    `model` must be the model before any training step (the base, or LoRA with zero adapters).
    With several processes the pass is collective: every process encodes the same batches,
    uploads its rows of each and gets the whole result back, so all hold the same cache; the
    pass runs unless every process can load the file, and only process 0 writes it.
    """
    data = cfg.data_config()
    fingerprint = ref_cache.fingerprint_of(
        data=dataclasses.asdict(data), model=dataclasses.asdict(cfg.model),
        tokenizer=dataclasses.asdict(cfg.tokenizer), vocab=tokenizer.vocab_size,
        quantization=cfg.quantization, dtype=cfg.dtype, seed=cfg.seed,
        loss_type=cfg.dpo.loss_type,
    )
    path = os.path.join(cfg.run_dir, ref_cache.CACHE_FILE)
    cached = ref_cache.load_cache(path, fingerprint)
    # Collective: a process without the file (a host-local run directory) makes all recompute.
    if distributed.max_over_processes(int(cached is None)) == 0 and cached is not None:
        return cached
    reference = reference_of(model) if has_lora(model) else model
    graphdef, weights = nnx.split(reference)
    forward = jax.jit(lambda w, b: forward_logprobs(nnx.merge(graphdef, w), b))

    def logprob_fn(batch: TrainBatch) -> np.ndarray:
        if batch_sharding is not None:  # every process holds the whole batch: keep its rows
            batch = distributed.global_batch_from_full(batch, batch_sharding)
        return distributed.fetch(forward(weights, batch))  # on every host (a collective)

    with perf.span(perf.TRAIN_EVAL, what="reference_logprobs"):
        cache = ref_cache.compute_reference_logprobs(data, tokenizer, logprob_fn)
    if distributed.is_main_process():
        ref_cache.save_cache(path, cache, fingerprint)
    distributed.barrier("nonstop.sft.reference_cache")
    return cache


def export_model(cfg: SFTRunConfig, state: TrainState, tokenizer: Tokenizer) -> str:
    """Merge adapters into the base and write a Hugging Face checkpoint to RUN_DIR/export; a
    LoRA run's adapters also go to RUN_DIR/adapters in PEFT's format."""
    model = policy_of(state.model())
    if has_lora(model):
        if cfg.quantization is None:  # PEFT adapters over a quantized base would not load
            save_adapters(model, os.path.join(cfg.run_dir, ADAPTERS_DIR),
                          base_model_name_or_path=cfg.model.path)
        model = merge_lora(model)
    _dequantize_rest(model)
    directory = os.path.join(cfg.run_dir, EXPORT_DIR)
    save_pretrained(model, directory, dtype=np.dtype(compute_dtype(cfg)))
    tokenizer.save_pretrained(directory)
    return directory


def _dequantize_rest(model: nnx.Module) -> None:
    """Quantized projections without an adapter (merge_lora leaves them) become float weights."""
    for block in model.layers:
        for name, (owner_name, _) in PROJECTIONS.items():
            owner = getattr(block, owner_name)
            weight = getattr(owner, name)
            if isinstance(weight, QuantizedWeight):
                setattr(owner, name, nnx.Param(weight.dequantize(jnp.float32),
                                               logical_axes=weight.logical_axes))


def train(
    cfg: SFTRunConfig,
    *,
    tokenizer: Tokenizer | None = None,
    on_step: Callable[[int], None] | None = None,
) -> RunResult:
    """Run (or resume) training as `cfg` says; `on_step(step)` is called after each step, once
    its checkpoint (if due) has been started.

    Under several processes (NONSTOP_COORDINATOR_ADDRESS... or NONSTOP_DISTRIBUTED=auto, see
    `nonstop.train.distributed`) every process calls `train` with the same config."""
    distributed.initialize(distributed.DistributedConfig.from_env())
    os.makedirs(cfg.run_dir, exist_ok=True)
    recording = (perf.run(distributed.process_run_dir(cfg.run_dir))
                 if perf.active_run_dir() is None else contextlib.nullcontext())
    with recording:
        return _train(cfg, load_tokenizer(cfg, tokenizer), on_step)


def _train(cfg: SFTRunConfig, tokenizer: Tokenizer, on_step: Callable[[int], None] | None
           ) -> RunResult:
    mesh = build_mesh(cfg)
    model = build_train_model(cfg, tokenizer, mesh)
    setup = setup_step(cfg, create_state(cfg, model), mesh)
    cache = None
    if _uses_precomputed_reference(cfg):
        cache = reference_cache(cfg, setup.state.model(), tokenizer, setup.batch_sharding)
    data = iter(ref_cache.training_dataset(cfg.data_config(), tokenizer, cache))
    flops_per_token = 6 * policy_of(model).cfg.num_params()
    del model

    checkpointer = Checkpointer(cfg.checkpoint.in_run(cfg.run_dir, CHECKPOINT_DIR))
    state, start = setup.state, 0
    restored = checkpointer.restore(state)
    if restored is not None:
        state, start = restored.state, restored.step
        if restored.data_state:
            data.set_state(restored.data_state)
    writer = MetricsWriter(distributed.process_run_dir(cfg.run_dir), cfg.metrics, total_steps=cfg.steps,
                           resume_step=start if restored is not None else None,
                           run_config=dataclasses.asdict(cfg))
    denominator = "pairs" if cfg.algorithm == "dpo" else "loss_tokens"
    step, last = start, None
    try:
        for step in range(start + 1, cfg.steps + 1):
            with perf.span(perf.TRAIN_DATA_WAIT, step=step):
                packed = next(data, None)
            if packed is None:
                distributed.print_main(
                    f"nonstop {cfg.algorithm}: the data ran out after step {step - 1}")
                step -= 1
                break
            with perf.span(perf.TRAIN_STEP, step=step):
                batch = setup.put(packed.batch)
                with perf.device_busy(perf.TRAINER, step=step):
                    state, metrics = setup.step(state, batch)
                    metrics["loss"].block_until_ready()
            stats = packed.stats
            perf.count(perf.TRAIN_TOKENS, stats.real_tokens)
            perf.count(perf.TRAIN_FLOPS, flops_per_token * stats.real_tokens)
            metrics[denominator] = metrics.pop("tokens")
            last = writer.write(step, {
                **metrics, "tokens": stats.real_tokens, "fill_ratio": stats.fill_ratio,
                "truncated_tokens": stats.truncated_tokens,
            }) or last
            if checkpointer.should_save(step):
                writer.flush()  # every metric up to a checkpoint is on disk before it
                with perf.span(perf.TRAIN_CHECKPOINT, step=step):
                    checkpointer.save(step, state, data_state=data.get_state(),
                                      metadata={"algorithm": cfg.algorithm})
            if on_step is not None:
                on_step(step)
        last = writer.flush() or last
        with perf.span(perf.TRAIN_CHECKPOINT, step=step):
            checkpointer.save(step, state, data_state=data.get_state(), force=True,
                              metadata={"algorithm": cfg.algorithm})
            checkpointer.wait()
    finally:
        writer.close()
        checkpointer.close()
    export_dir = None
    if cfg.export:
        # Gathering the weights to every host is collective; one host writes them.
        host_state = state if jax.process_count() == 1 else state.replace(
            params=distributed.fetch(state.params), frozen=distributed.fetch(state.frozen))
        if distributed.is_main_process():
            export_dir = export_model(cfg, host_state, tokenizer)
        distributed.barrier("nonstop.sft.export")
    return RunResult(run_dir=cfg.run_dir, start_step=start, last_step=step, last_metrics=last,
                     export_dir=export_dir, state=state)
