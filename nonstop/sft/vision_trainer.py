"""SFT and DPO of a Gemma 3 vision-language model on image + text JSONL, from Python.

    result = train_vision(VisionTrainConfig(model_path=..., data_path=..., kind="sft", ...),
                          tokenizer=tokenizer)

Read top to bottom: load the checkpoint (`load_pretrained` gives a `Gemma3VLM`), wrap LoRA on
the language model (and, with `vision_lora`, on the vision attention), read the examples
(`vision_data` / `vision_preference`: bad input fails here, naming the example), then the one
jitted step of `make_train_step` over fixed-shape batches (one example per row), and finally,
with `output_dir`, merge the adapters and write a checkpoint transformers loads, with the
processor's `preprocessor_config.json` beside it.

Departures from the text trainer (`trainer.py`): no packing (an example per row), no mesh, no
resume, no gradient accumulation — what the CLI's Grain pipeline adds for text is not yet
wired to images.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal, get_args

import jax
import numpy as np
import optax
from flax import nnx

from nonstop.models.checkpoint import load_pretrained, save_pretrained
from nonstop.models.image_processor import ImageProcessor
from nonstop.models.lora import LoRAConfig, apply_lora, merge_lora
from nonstop.models.multimodal import Gemma3VLM
from nonstop.models.vision import VISION_LORA_TARGETS, apply_vision_lora, merge_vision_lora
from nonstop.sft.losses import DPOConfig
from nonstop.sft.vision_data import TextEncoder, make_vision_batch, read_vision_sft, vision_sft_loss
from nonstop.sft.vision_preference import read_vision_preference, vision_dpo_loss_fn
from nonstop.train.state import TrainState
from nonstop.train.step import make_train_step

VisionTask = Literal["sft", "dpo"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionTrainConfig:
    """What to train, on what, and how long."""

    model_path: str
    data_path: str
    kind: VisionTask = "sft"
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 512  # tokens per row, image tokens included (pairs: both segments)
    max_images: int = 8  # images per batch (pairs count each image twice)
    learning_rate: float = 1e-4
    lora: LoRAConfig = LoRAConfig()
    vision_lora: bool = False  # also adapt the vision tower's attention (q, k, v, o)
    dpo: DPOConfig = DPOConfig()
    seed: int = 0
    output_dir: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in get_args(VisionTask):
            raise ValueError(f"VisionTrainConfig.kind={self.kind!r}; valid: "
                             f"{get_args(VisionTask)}")
        for name in ("steps", "batch_size", "seq_len", "max_images"):
            if getattr(self, name) < 1:
                raise ValueError(f"VisionTrainConfig.{name} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if not self.learning_rate > 0:
            raise ValueError(f"VisionTrainConfig.learning_rate must be > 0, got "
                             f"{self.learning_rate}")


@dataclasses.dataclass(frozen=True)
class VisionTrainResult:
    model: Gemma3VLM  # adapters merged when exported, still wrapped otherwise
    losses: list[float]
    metrics: list[dict[str, float]]
    export_dir: str | None


def train_vision(cfg: VisionTrainConfig, *, tokenizer: TextEncoder,
                 processor: ImageProcessor | None = None) -> VisionTrainResult:
    """Run the whole training; `processor` defaults to the checkpoint's preprocessor config."""
    model = load_pretrained(cfg.model_path)
    if not isinstance(model, Gemma3VLM):
        raise ValueError(f"{cfg.model_path}: not a vision-language checkpoint "
                         "(Gemma3ForConditionalGeneration); use the text trainer")
    if processor is None:
        processor = ImageProcessor.from_pretrained(cfg.model_path)
    apply_lora(model, cfg.lora, seed=cfg.seed)
    if cfg.vision_lora:
        vision_targets = tuple(t for t in cfg.lora.targets if t in VISION_LORA_TARGETS)
        if not vision_targets:
            raise ValueError(f"vision_lora: lora.targets {cfg.lora.targets} name no attention "
                             f"projection; the vision tower adapts {VISION_LORA_TARGETS}")
        apply_vision_lora(model.vision, dataclasses.replace(cfg.lora, targets=vision_targets),
                          seed=cfg.seed + 1)
    if cfg.kind == "sft":
        examples = read_vision_sft(cfg.data_path, tokenizer, processor, model.vlm_cfg)
        loss_fn = vision_sft_loss
    else:
        examples = read_vision_preference(cfg.data_path, tokenizer, processor, model.vlm_cfg)
        loss_fn = vision_dpo_loss_fn(cfg.dpo)
    if not examples:
        raise ValueError(f"{cfg.data_path}: no examples")
    optimizer = optax.adam(cfg.learning_rate)
    state = TrainState.create(model, optimizer, rng=jax.random.key(cfg.seed), wrt=nnx.LoRAParam)
    step = make_train_step(loss_fn, optimizer)
    rng = np.random.RandomState(cfg.seed)
    order: list[int] = []
    losses, metrics = [], []
    for _ in range(cfg.steps):
        if len(order) < cfg.batch_size:  # a new epoch: reshuffle
            order += rng.permutation(len(examples)).tolist()
        take, order = order[:cfg.batch_size], order[cfg.batch_size:]
        batch = make_vision_batch([examples[i] for i in take], seq_len=cfg.seq_len,
                                  max_images=cfg.max_images)
        state, out = step(state, batch)
        host = {k: float(v) for k, v in jax.device_get(out).items()}
        losses.append(host["loss"])
        metrics.append(host)
    model = state.model()
    export_dir = None
    if cfg.output_dir is not None:
        merge_lora(model)
        merge_vision_lora(model.vision)
        save_pretrained(model, cfg.output_dir)
        export_dir = cfg.output_dir
        (Path(export_dir) / "preprocessor_config.json").write_text(
            json.dumps(processor.to_dict(), indent=2))
    return VisionTrainResult(model=model, losses=losses, metrics=metrics, export_dir=export_dir)


__all__ = ["VisionTrainConfig", "VisionTrainResult", "train_vision"]
