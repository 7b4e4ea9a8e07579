"""The trainer behind `nonstop vlm`: SFT or DPO of a Gemma 3 vision-language model with LoRA.

    result = train_vision(load_config(VisionTrainConfig, "vlm_sft_gemma3_4b.yaml", overrides))

Read top to bottom: load the checkpoint (`load_pretrained` gives a `Gemma3VLM`), its tokenizer
(unless one is passed) and image processor; wrap LoRA on the language model (and, with
`vision_lora`, on the vision attention); read the examples (`vision_data` / `vision_preference`:
bad input fails here, naming the file and line); place the `TrainState` on the (data, fsdp, tp)
`mesh`, sharded by the model's logical axes (the vision tower's too: see `models/vision.py`);
then the one jitted step of `make_train_step` (the optimizer and schedule of
`nonstop.train.optim`) over fixed-shape batches, one example per row, recorded through
`nonstop.perf` and written by `MetricsWriter` to RUN_DIR/metrics.jsonl and RUN_DIR/tensorboard;
finally, with `export`, merge the adapters and write a checkpoint transformers loads to
RUN_DIR/export, with the tokenizer and `preprocessor_config.json` beside it.

Checkpoints are the text trainer's (`nonstop.train.Checkpointer`: Orbax, atomic, asynchronous)
in RUN_DIR/checkpoints every `checkpoint.save_every` steps, after the last step, and when
`stop_requested()` turns true (the CLI's SIGTERM): the trainable params (the adapters), the
optimizer state, the step and the RNG key, with the data cursor as JSON — how many examples of
the `ExampleOrder` stream were consumed, plus the number of examples and the data file's SHA-256,
so that a resume on other data is refused. Run again on the same RUN_DIR, `train_vision` restores the latest
complete checkpoint and continues exactly: the same batches, the same dropout keys, the same
parameters as a run never stopped. Which data lines each step trained on is logged to
RUN_DIR/examples.jsonl (steps after the restored checkpoint are dropped on resume, like
metrics.jsonl's).

The mesh is the text trainer's: `mesh.data x mesh.fsdp x mesh.tp` devices (the first ones; one
device, no mesh, by default). A batch's rows are split over ("data", "fsdp"), and so is its image
array on its own leading axis (`max_images`, not rows: images are a flat list merged into the
placeholders in row-major order), so the vision tower encodes a slice of the images on each
device; `batch_size` and `max_images` must both be multiples of `mesh.data x mesh.fsdp`. Under
`jax.distributed` (NONSTOP_COORDINATOR_ADDRESS... or NONSTOP_DISTRIBUTED=auto, see
`nonstop.train.distributed`) every process runs with the same config over one global mesh,
reads the same examples in the same order and uploads only its own rows and images of each
batch; metrics and the perf trace go to RUN_DIR on process 0 (RUN_DIR/process_N elsewhere), and
the weights are gathered on every process (a collective) before process 0 alone writes the
export.

Metrics per step: loss, learning_rate, grad_norm, the loss's denominator (`loss_tokens` for SFT,
`pairs` for DPO), tokens (real tokens in the batch, image placeholders included) and
tokens_per_second, images (real images in the batch), and for DPO the DPO metrics.

Departures from the text trainer (`trainer.py`): no packing (an example per row), no gradient
accumulation, and every image is decoded up front into host memory (on every process) — what the
text trainer's Grain pipeline adds is not yet wired to images.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from nonstop import perf
from nonstop.models.chat import ChatTemplate
from nonstop.models.checkpoint import load_pretrained, save_pretrained
from nonstop.models.image_processor import ImageProcessor
from nonstop.models.lora import LoRAConfig, apply_lora, merge_lora, reseeded
from nonstop.models.multimodal import Gemma3VLM
from nonstop.models.sharding import MeshShape
from nonstop.models.tokenizer import Tokenizer
from nonstop.models.validation import check, check_choice, check_ints
from nonstop.models.vision import VISION_LORA_TARGETS, apply_vision_lora, merge_vision_lora
from nonstop.sft.losses import DPOConfig
from nonstop.sft.vision_data import (
    TextEncoder,
    VisionBatch,
    VisionDataError,
    VisionExample,
    make_vision_batch,
    read_vision_sft,
    vision_sft_loss,
)
from nonstop.sft.vision_preference import read_vision_preference, vision_dpo_loss_fn
from nonstop.train import distributed
from nonstop.train.checkpoint import CheckpointConfig, Checkpointer, Restored
from nonstop.train.metrics import MetricsConfig, MetricsWriter, truncate_jsonl
from nonstop.train.optim import OptimizerConfig
from nonstop.train.state import TrainState
from nonstop.train.step import LossFn, StepSetup, setup_train_step

VisionTask = Literal["sft", "dpo"]
Dtype = Literal["float32", "bfloat16"]
EXPORT_DIR = "export"
CHECKPOINT_DIR = "checkpoints"
EXAMPLES_LOG = "examples.jsonl"  # per step: the data lines (1-based) its batch held


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionTrainConfig:
    """Everything one `nonstop vlm` run needs: what to train, on what, how and how long.

    `optimizer.total_steps` (the schedule's length) follows `steps`; leave it unset.
    """

    kind: VisionTask = "sft"
    model_path: str  # a local Gemma3ForConditionalGeneration checkpoint directory
    data_path: str  # JSONL; image paths in it are relative to its directory
    tokenizer_path: str | None = None  # None: the tokenizer files in model_path
    run_dir: str = "runs/vlm"
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 512  # tokens per row, image tokens included (pairs: both segments)
    max_images: int = 8  # images per batch (pairs count each image twice)
    dtype: Dtype = "float32"  # compute and frozen-base dtype; adapters train in float32
    optimizer: OptimizerConfig = OptimizerConfig()
    lora: LoRAConfig = LoRAConfig()
    vision_lora: bool = False  # also adapt the vision tower's attention (q, k, v, o)
    dpo: DPOConfig = DPOConfig()
    metrics: MetricsConfig = MetricsConfig()
    # RUN_DIR/checkpoints every save_every steps, after the last step and on SIGTERM; rerunning
    # on the same run_dir (or `nonstop vlm --resume RUN_DIR`) continues from the latest.
    checkpoint: CheckpointConfig = CheckpointConfig(save_every=500, keep_last=3)
    mesh: MeshShape = MeshShape()  # data x fsdp x tp devices; the default is one device
    seed: int = 0
    export: bool = True  # merge the adapters and save_pretrained into RUN_DIR/export

    def __post_init__(self) -> None:
        owner = "VisionTrainConfig"
        check_choice(owner, "kind", self.kind, VisionTask)
        check_choice(owner, "dtype", self.dtype, Dtype)
        for name in ("model_path", "data_path", "run_dir"):
            check(bool(getattr(self, name)), owner, name, getattr(self, name), "a path")
        check_ints(owner, self, ("steps", "batch_size", "seq_len", "max_images"))
        shards = self.mesh.data * self.mesh.fsdp
        for name in ("batch_size", "max_images"):
            check(getattr(self, name) % shards == 0, owner, name, getattr(self, name),
                  f"a multiple of mesh.data x mesh.fsdp = {self.mesh.data} x {self.mesh.fsdp} = "
                  f"{shards} (rows and images are split evenly over those devices), or change "
                  "the mesh")
        check(not self.vision_lora or bool(set(self.lora.targets) & set(VISION_LORA_TARGETS)),
              owner, "lora.targets", self.lora.targets,
              f"with vision_lora, at least one of {VISION_LORA_TARGETS}")
        check(self.optimizer.total_steps in (OptimizerConfig().total_steps, self.steps), owner,
              "optimizer.total_steps", self.optimizer.total_steps,
              f"to be left unset: it follows steps={self.steps}")
        check(0 <= self.optimizer.warmup_steps <= self.steps, owner, "optimizer.warmup_steps",
              self.optimizer.warmup_steps, f"an int in [0, steps={self.steps}]")
        object.__setattr__(
            self, "optimizer", dataclasses.replace(self.optimizer, total_steps=self.steps))


@dataclasses.dataclass(frozen=True)
class VisionTrainResult:
    """What a finished `train_vision` call did."""

    run_dir: str
    model: Gemma3VLM  # adapters merged when exported, still wrapped otherwise
    # (exported under several processes: gathered host copies on every process)
    losses: list[float]
    metrics: list[dict[str, float]]  # the records this call wrote to metrics.jsonl, one a step
    export_dir: str | None
    start_step: int = 0  # 0, or the checkpoint step it resumed from
    last_step: int = 0  # the last step taken
    stopped: bool = False  # stop_requested() ended it early, after a checkpoint (no export)


def load_vision_tokenizer(cfg: VisionTrainConfig) -> Tokenizer:
    """The tokenizer at `tokenizer_path`, or the one saved with the checkpoint."""
    return Tokenizer.from_pretrained(cfg.tokenizer_path or cfg.model_path)


def train_vision(cfg: VisionTrainConfig, *, tokenizer: TextEncoder | None = None,
                 processor: ImageProcessor | None = None,
                 stop_requested: Callable[[], bool] | None = None) -> VisionTrainResult:
    """Run (or resume, from RUN_DIR's latest checkpoint) the whole training; `tokenizer`
    defaults to `load_vision_tokenizer(cfg)` and `processor` to the checkpoint's preprocessor
    config. `stop_requested()` is asked after each step: once true, the run checkpoints that
    step and returns with `stopped=True` (the CLI wires it to SIGTERM).

    Under several processes (NONSTOP_COORDINATOR_ADDRESS... or NONSTOP_DISTRIBUTED=auto, see
    `nonstop.train.distributed`) every process calls it with the same config."""
    distributed.initialize(distributed.DistributedConfig.from_env())
    if not Path(cfg.model_path).is_dir():
        raise FileNotFoundError(f"model_path={cfg.model_path!r}: not a directory; give a local "
                                "Gemma 3 vision-language checkpoint (Hugging Face layout)")
    if not Path(cfg.data_path).is_file():
        raise FileNotFoundError(f"data_path={cfg.data_path!r}: no such file; give a JSONL file "
                                "of image + text examples")
    os.makedirs(cfg.run_dir, exist_ok=True)
    recording = (perf.run(distributed.process_run_dir(cfg.run_dir))
                 if perf.active_run_dir() is None else contextlib.nullcontext())
    with recording:
        return _train(cfg, tokenizer if tokenizer is not None else load_vision_tokenizer(cfg),
                      processor, stop_requested)


def build_vision_model(cfg: VisionTrainConfig, tokenizer: TextEncoder) -> Gemma3VLM:
    """The checkpoint in `dtype` with LoRA on the language model (and the vision attention)."""
    dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
    model = load_pretrained(cfg.model_path, dtype=dtype, param_dtype=dtype)
    if not isinstance(model, Gemma3VLM):
        raise ValueError(f"{cfg.model_path}: not a vision-language checkpoint "
                         "(Gemma3ForConditionalGeneration); train it with `nonstop sft`")
    if isinstance(tokenizer, Tokenizer) and tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's "
                         f"embedding table only {model.cfg.vocab_size}; use the checkpoint's own "
                         "tokenizer (tokenizer_path=null)")
    apply_lora(model, cfg.lora, seed=cfg.seed)
    if cfg.vision_lora:
        vision_targets = tuple(t for t in cfg.lora.targets if t in VISION_LORA_TARGETS)
        apply_vision_lora(model.vision, dataclasses.replace(cfg.lora, targets=vision_targets),
                          seed=cfg.seed + 1)
    return model


def read_examples(cfg: VisionTrainConfig, model: Gemma3VLM, tokenizer: TextEncoder,
                  processor: ImageProcessor) -> list[VisionExample]:
    """Every example of `data_path`, images decoded; `messages` records use the tokenizer's
    chat template when it has one."""
    if cfg.kind == "dpo":
        examples = read_vision_preference(cfg.data_path, tokenizer, processor, model.vlm_cfg)
    else:
        template = None
        if isinstance(tokenizer, Tokenizer) and tokenizer.chat_template is not None:
            template = ChatTemplate.from_tokenizer(tokenizer)
        examples = read_vision_sft(cfg.data_path, tokenizer, processor, model.vlm_cfg,
                                   template=template)
    if not examples:
        raise ValueError(f"{cfg.data_path}: no examples")
    check_fits(cfg, examples)
    return examples


def example_lines(data_path: str) -> list[int]:
    """The 1-based line of each example: the readers make one of each non-blank line, in order."""
    return [n for n, line in enumerate(Path(data_path).read_text().splitlines(), start=1)
            if line.strip()]


def check_fits(cfg: VisionTrainConfig, examples: list[VisionExample]) -> None:
    """Every example fits a row and a batch's images, checked before training starts (not at
    the step that first draws it); errors name the file and line."""
    for example, lineno in zip(examples, example_lines(cfg.data_path), strict=True):
        where = f"{cfg.data_path}:{lineno}"
        if len(example.tokens) > cfg.seq_len:
            raise VisionDataError(f"{where}: the example has {len(example.tokens)} tokens (image "
                                  f"tokens included), more than seq_len={cfg.seq_len}; raise "
                                  "seq_len or shorten the example")
        if len(example.images) > cfg.max_images:
            raise VisionDataError(f"{where}: the example has {len(example.images)} images (a "
                                  f"pair counts each twice), more than max_images="
                                  f"{cfg.max_images}; raise max_images")


def make_loss_fn(cfg: VisionTrainConfig) -> LossFn:
    loss_fn = vision_sft_loss if cfg.kind == "sft" else vision_dpo_loss_fn(cfg.dpo)
    if cfg.lora.dropout == 0:
        return loss_fn

    def with_dropout(model: nnx.Module, batch: VisionBatch, rng: jax.Array):
        # A fresh LoRA dropout mask each step from the step's key (`reseeded`: why a copy).
        return loss_fn(reseeded(model, rng), batch, rng)

    return with_dropout


def build_mesh(cfg: VisionTrainConfig) -> Mesh | None:
    """The (data, fsdp, tp) mesh of `cfg.mesh` (`distributed.trainer_mesh`); None: one device."""
    return distributed.trainer_mesh(data=cfg.mesh.data, fsdp=cfg.mesh.fsdp, tp=cfg.mesh.tp)


def setup_step(cfg: VisionTrainConfig, state: TrainState, mesh: Mesh | None) -> StepSetup:
    """The jitted step for `cfg`; with a mesh, the state sharded by its logical axes (every
    process holds the same values and uploads its own shards). `put` splits each leaf of a
    `VisionBatch` on its own leading axis: rows for the token arrays, `max_images` slots for
    the images."""
    return setup_train_step(state, make_loss_fn(cfg), cfg.optimizer, mesh=mesh)


def flops_per_example(model: Gemma3VLM) -> tuple[int, int]:
    """6 x parameters per token of the language model and per patch of the vision tower (the
    usual 6N estimate, for the report's MFU; the vision tower runs once per image patch)."""
    base = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
    vision_params = sum(x.size for x in jax.tree.leaves(nnx.state(model.vision, base)))
    vision = model.vlm_cfg.vision
    patches = (vision.image_size // vision.patch_size) ** 2
    return 6 * model.cfg.num_params(), 6 * vision_params * patches


class ExampleOrder:
    """The order examples are drawn in: epoch after epoch, each a fresh permutation of
    RandomState(seed), a batch taking the next `batch_size` (a batch never spans two epochs'
    draws unless the current one runs short: then the next permutation is appended first). The
    whole position is `consumed`, the number of examples taken so far: `skip(consumed)` replays
    the permutations drawn before it, so a resumed run takes the same batches."""

    def __init__(self, num_examples: int, seed: int) -> None:
        self.num_examples = num_examples
        self.consumed = 0
        self._rng = np.random.RandomState(seed)
        self._pending: list[int] = []

    def take(self, n: int) -> list[int]:
        """The next `n` example indices (fewer only when there are fewer than `n` examples)."""
        if len(self._pending) < n:
            self._pending += self._rng.permutation(self.num_examples).tolist()
        taken, self._pending = self._pending[:n], self._pending[n:]
        self.consumed += len(taken)
        return taken

    def skip(self, consumed: int) -> None:
        """Move a fresh order to position `consumed` (what `take` calls would have drawn)."""
        while len(self._pending) < consumed - self.consumed:
            self._pending += self._rng.permutation(self.num_examples).tolist()
        skipped = consumed - self.consumed
        self._pending, self.consumed = self._pending[skipped:], consumed


def data_fingerprint(data_path: str, num_examples: int) -> dict[str, Any]:
    """What a checkpoint records of its data, so that a resume on another file is refused."""
    digest = hashlib.sha256(Path(data_path).read_bytes()).hexdigest()
    return {"num_examples": num_examples, "data_sha256": digest}


def resume_position(cfg: VisionTrainConfig, restored: Restored,
                    fingerprint: dict[str, Any]) -> int:
    """The examples consumed up to the restored checkpoint, after checking that it was written
    by a run of the same kind on the same data."""
    data, meta = restored.data_state or {}, restored.metadata or {}
    directory = cfg.checkpoint.in_run(cfg.run_dir, CHECKPOINT_DIR).directory
    where = f"the checkpoint of step {restored.step} in {directory}"
    if meta.get("kind", cfg.kind) != cfg.kind:
        raise ValueError(f"kind={cfg.kind!r}, but {where} is of a kind={meta['kind']!r} run; "
                         "resume with the same kind or start a new run_dir")
    for key, value in fingerprint.items():
        if data.get(key) != value:
            raise ValueError(f"data_path={cfg.data_path!r} is not the data {where} was trained "
                             f"on ({key} {data.get(key)!r}, now {value!r}); resume with the same "
                             "file or start a new run_dir")
    return int(data["examples_consumed"])


def _train(cfg: VisionTrainConfig, tokenizer: TextEncoder, processor: ImageProcessor | None,
           stop_requested: Callable[[], bool] | None) -> VisionTrainResult:
    mesh = build_mesh(cfg)
    # Loaded onto one device, then placed on the mesh with the optimizer state (put_global).
    model = build_vision_model(cfg, tokenizer)
    if processor is None:
        processor = ImageProcessor.from_pretrained(cfg.model_path)
    flops_per_token, flops_per_image = flops_per_example(model)
    with perf.span(perf.TRAIN_DATA_WAIT, what="read_examples"):
        examples = read_examples(cfg, model, tokenizer, processor)
    setup = setup_train_step(model, make_loss_fn(cfg), cfg.optimizer, seed=cfg.seed,
                             wrt=nnx.LoRAParam, mesh=mesh)
    del model
    denominator = "pairs" if cfg.kind == "dpo" else "loss_tokens"
    lines = example_lines(cfg.data_path)
    fingerprint = data_fingerprint(cfg.data_path, len(examples))
    order = ExampleOrder(len(examples), cfg.seed)
    checkpointer = Checkpointer(cfg.checkpoint.in_run(cfg.run_dir, CHECKPOINT_DIR))
    state, start = setup.state, 0
    if mesh is None:
        # Committed now, as the step's outputs and a restored state are: otherwise the first
        # step compiles for uncommitted inputs and the second compiles again.
        state = jax.device_put(state, jax.devices()[0])
    restored = checkpointer.restore(state)
    if restored is not None:
        order.skip(resume_position(cfg, restored, fingerprint))
        state, start = restored.state, restored.step
    own_dir = distributed.process_run_dir(cfg.run_dir)
    examples_log = Path(own_dir) / EXAMPLES_LOG
    truncate_jsonl(str(examples_log), start)  # a fresh run keeps none of an old one's

    def save(step: int, force: bool) -> None:
        checkpointer.save(step, state, force=force, metadata={"kind": cfg.kind},
                          data_state={"examples_consumed": order.consumed, **fingerprint})

    records: list[dict[str, float]] = []
    step, stopped = start, False
    writer = MetricsWriter(own_dir, cfg.metrics, total_steps=cfg.steps,
                           resume_step=start if restored is not None else None,
                           run_config=dataclasses.asdict(cfg))
    try:
        with writer, examples_log.open("a") as log:
            for step in range(start + 1, cfg.steps + 1):
                with perf.span(perf.TRAIN_DATA_WAIT, step=step):
                    take = order.take(cfg.batch_size)
                    chosen = [examples[i] for i in take]
                    batch = make_vision_batch(chosen, seq_len=cfg.seq_len,
                                              max_images=cfg.max_images)
                with perf.span(perf.TRAIN_STEP, step=step):
                    placed = setup.put(batch)
                    with perf.device_busy(perf.TRAINER, step=step):
                        state, metrics = setup.step(state, placed)
                        metrics["loss"].block_until_ready()
                tokens = int(np.count_nonzero(batch.segment_ids))
                images = sum(len(ex.images) for ex in chosen)
                perf.count(perf.TRAIN_TOKENS, tokens)
                perf.count(perf.TRAIN_FLOPS, flops_per_token * tokens + flops_per_image * images)
                metrics[denominator] = metrics.pop("tokens")
                written = writer.write(step, {**metrics, "tokens": tokens, "images": images})
                if written is not None:
                    records.append(written)
                log.write(json.dumps({"step": step, "lines": [lines[i] for i in take]}) + "\n")
                log.flush()  # on disk before any checkpoint of this step
                stopped = stop_requested is not None and stop_requested()
                if jax.process_count() > 1:  # all processes stop at the same step
                    stopped = bool(distributed.max_over_processes(int(stopped)))
                if checkpointer.should_save(step) or stopped:
                    written = writer.flush()  # every metric up to a checkpoint is on disk first
                    if written is not None:
                        records.append(written)
                    with perf.span(perf.TRAIN_CHECKPOINT, step=step):
                        save(step, force=stopped)
                if stopped:
                    break
            written = writer.flush()
            if written is not None:
                records.append(written)
        with perf.span(perf.TRAIN_CHECKPOINT, step=step):
            save(step, force=True)  # a no-op when this step is saved already
            checkpointer.wait()
    finally:
        checkpointer.close()
    losses = [r["loss"] for r in records]
    if stopped:
        return VisionTrainResult(run_dir=cfg.run_dir, model=state.model(), losses=losses,
                                 metrics=records, export_dir=None, start_step=start,
                                 last_step=step, stopped=True)
    export_dir = None
    if cfg.export:
        if jax.process_count() > 1:  # gathering the weights to every host is collective
            state = state.replace(params=distributed.fetch(state.params),
                                  frozen=distributed.fetch(state.frozen))
        model = state.model()
        if distributed.is_main_process():
            export_dir = export_vision_model(cfg, model, tokenizer, processor)
        else:
            merge_vision_adapters(model)
        distributed.barrier("nonstop.vlm.export")
    else:
        model = state.model()
    return VisionTrainResult(run_dir=cfg.run_dir, model=model, losses=losses, metrics=records,
                             export_dir=export_dir, start_step=start, last_step=step)


def merge_vision_adapters(model: Gemma3VLM) -> Gemma3VLM:
    """Fold the language model's and the vision tower's adapters into their weights (in place)."""
    merge_lora(model)
    merge_vision_lora(model.vision)
    return model


def export_vision_model(cfg: VisionTrainConfig, model: Gemma3VLM, tokenizer: TextEncoder,
                        processor: ImageProcessor) -> str:
    """Merge the adapters (in place) and write RUN_DIR/export: weights, tokenizer (when it is a
    `Tokenizer`) and `preprocessor_config.json`, a directory transformers loads."""
    merge_vision_adapters(model)
    directory = os.path.join(cfg.run_dir, EXPORT_DIR)
    save_pretrained(model, directory)
    if isinstance(tokenizer, Tokenizer):
        tokenizer.save_pretrained(directory)
    (Path(directory) / "preprocessor_config.json").write_text(
        json.dumps(processor.to_dict(), indent=2))
    return directory


__all__ = ["CHECKPOINT_DIR", "EXAMPLES_LOG", "EXPORT_DIR", "ExampleOrder", "VisionTrainConfig",
           "VisionTrainResult",
           "build_mesh", "build_vision_model", "export_vision_model", "load_vision_tokenizer",
           "merge_vision_adapters", "setup_step", "train_vision"]
