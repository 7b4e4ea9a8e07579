"""The configuration of one supervised or preference-tuning run (`nonstop sft · dpo · orpo`).

`SFTRunConfig` is the root of a tree of frozen dataclasses that YAML files and dotted overrides
fill in (`nonstop.recipes.config_io`). It reuses the components' own configs — `DataConfig`,
`PackingConfig`, `OptimizerConfig`, `LoRAConfig`, `QuantConfig`, `DPOConfig`, `ORPOConfig`,
`MetricsConfig` — and adds what only a run knows: where the model and tokenizer come from, the
built-in data, dtype, steps and seed. Model and tokenizer sources, checkpoints and the mesh
use the shared `ModelSource`, `TokenizerSource`, `CheckpointConfig` and `MeshShape`.

Two rules keep one source of truth per setting:
- `packing` lives at the top level and applies to every data source; `data.packing` must stay at
  its default.
- `optimizer.total_steps` (the schedule's length) follows `steps`; leave it unset.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from nonstop.models.lora import LoRAConfig
from nonstop.models.quantize import QuantConfig
from nonstop.models.sharding import MeshShape
from nonstop.models.source import ModelSource, TokenizerSource
from nonstop.models.validation import ConfigError, check_choice, invalid
from nonstop.sft.data import DataConfig
from nonstop.sft.losses import DPOConfig, ORPOConfig
from nonstop.train.checkpoint import CheckpointConfig
from nonstop.train.metrics import MetricsConfig
from nonstop.train.optim import OptimizerConfig
from nonstop.train.packing import PackingConfig

Algorithm = Literal["sft", "dpo", "orpo"]
Dtype = Literal["float32", "bfloat16"]
ReferenceMode = Literal["precomputed", "on_the_fly"]
BuiltinTask = Literal["reverse", "arithmetic"]
RejectedKind = Literal["mistake", "shout"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuiltinData:
    """A built-in synthetic task written as JSONL into the run directory (`nonstop.recipes`).

    `rejected` (preference data): "mistake" — a wrong answer (unreversed, a letter changed, an
    off-by-a-few sum); "shout" — the right answer in upper case, a style preference that a model
    trained from scratch can pick up in a few dozen steps."""

    task: BuiltinTask = "reverse"
    rejected: RejectedKind = "mistake"
    num_train: int = 2000
    num_eval: int = 64
    min_length: int = 3
    max_length: int = 6
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("BuiltinData", "task", self.task, BuiltinTask)
        check_choice("BuiltinData", "rejected", self.rejected, RejectedKind)
        if self.num_train < 1 or self.num_eval < 1:
            raise invalid("BuiltinData", "num_train/num_eval", (self.num_train, self.num_eval), "ints >= 1")
        if not 1 <= self.min_length <= self.max_length:
            raise invalid("BuiltinData", "min_length", self.min_length, f"in [1, max_length={self.max_length}]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTRunConfig:
    """Everything one `nonstop sft | dpo | orpo` run needs."""

    algorithm: Algorithm = "sft"
    run_dir: str = "runs/sft"
    steps: int = 100
    seed: int = 0
    dtype: Dtype = "float32"
    grad_accum_steps: int = 1
    model: ModelSource = ModelSource()
    tokenizer: TokenizerSource = TokenizerSource()
    data: DataConfig | None = None
    builtin_data: BuiltinData | None = None
    packing: PackingConfig = PackingConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    lora: LoRAConfig | None = None
    quantization: QuantConfig | None = None
    dpo: DPOConfig = DPOConfig()
    reference: ReferenceMode = "precomputed"
    orpo: ORPOConfig = ORPOConfig()
    checkpoint: CheckpointConfig = CheckpointConfig(save_every=500)
    metrics: MetricsConfig = MetricsConfig()
    mesh: MeshShape = MeshShape()
    export: bool = True  # merge adapters (if any) and save_pretrained into RUN_DIR/export

    def __post_init__(self) -> None:
        check_choice("SFTRunConfig", "algorithm", self.algorithm, Algorithm)
        check_choice("SFTRunConfig", "dtype", self.dtype, Dtype)
        check_choice("SFTRunConfig", "reference", self.reference, ReferenceMode)
        if not self.run_dir:
            raise invalid("SFTRunConfig", "run_dir", self.run_dir, "a directory path")
        if self.steps < 1:
            raise invalid("SFTRunConfig", "steps", self.steps, "an int >= 1")
        if self.grad_accum_steps < 1:
            raise invalid("SFTRunConfig", "grad_accum_steps", self.grad_accum_steps, "an int >= 1")
        if (self.data is None) == (self.builtin_data is None):
            raise invalid("SFTRunConfig", "builtin_data", self.builtin_data,
                  ("null when data is set" if self.data is not None else
                   "a built-in synthetic task (builtin_data.task=...) when data is not set")
                  + "; set exactly one of data (your .jsonl/.parquet files: data.paths=...) and "
                  "builtin_data")
        if self.data is not None:
            if self.data.packing != PackingConfig():
                raise invalid("SFTRunConfig", "data.packing", self.data.packing,
                      "unset: set packing.* at the top level (it applies to every data source)")
            want = "preference" if self.algorithm != "sft" else None
            if want and self.data.kind != want:
                raise invalid("SFTRunConfig", "data.kind", self.data.kind, f"'preference' for {self.algorithm}")
            if not want and self.data.kind == "preference":
                raise invalid("SFTRunConfig", "data.kind", self.data.kind, "text, prompt_completion or chat "
                      "for sft (preference data trains with dpo or orpo)")
        if self.algorithm != "sft" and self.packing.max_segments_per_row % 2:
            raise invalid("SFTRunConfig", "packing.max_segments_per_row", self.packing.max_segments_per_row,
                  "an even int for preference pairs")
        rows = self.packing.rows_per_batch
        shards = self.mesh.data * self.mesh.fsdp
        if rows % (self.grad_accum_steps * shards):
            raise invalid("SFTRunConfig", "packing.rows_per_batch", rows,
                  f"a multiple of grad_accum_steps x mesh.data x mesh.fsdp = "
                  f"{self.grad_accum_steps * shards}")
        if self.quantization is not None and self.lora is None:
            raise invalid("SFTRunConfig", "lora", self.lora, "adapters (lora.rank=...) when quantization "
                  "is set (QLoRA): quantized weights cannot be trained")
        if self.tokenizer.kind == "pretrained" and self.tokenizer.path is None \
                and self.model.path is None:
            raise invalid("SFTRunConfig", "tokenizer.path", self.tokenizer.path,
                  "a tokenizer directory when tokenizer.kind='pretrained' and model.path is "
                  "unset (or tokenizer.kind=char for the built-in character tokenizer)")
        default_total = OptimizerConfig().total_steps
        if self.optimizer.total_steps not in (default_total, self.steps):
            raise invalid("SFTRunConfig", "optimizer.total_steps", self.optimizer.total_steps,
                  f"to be left unset: it follows steps={self.steps}")
        if self.optimizer.warmup_steps > self.steps:
            raise invalid("SFTRunConfig", "optimizer.warmup_steps", self.optimizer.warmup_steps,
                  f"an int in [0, steps={self.steps}]")
        object.__setattr__(
            self, "optimizer", dataclasses.replace(self.optimizer, total_steps=self.steps)
        )

    def data_config(self) -> DataConfig:
        """The data settings the pipeline runs with (top-level packing applied)."""
        if self.data is None:
            raise ConfigError(
                "SFTRunConfig.data is not set: built-in data must be written first "
                "(nonstop.recipes.sft_data.materialize)"
            )
        return dataclasses.replace(self.data, packing=self.packing)
