"""`nonstop export RUN_DIR [--out DIR] [--adapters [--with-base]]`: a run's weights for other tools.

Reads RUN_DIR/config.yaml (a `nonstop sft | dpo | orpo` or `nonstop rl` run), rebuilds the model
as the run did (base weights, quantization, LoRA), restores the latest complete checkpoint, then
writes

- by default, a merged Hugging Face checkpoint (adapters folded into the base) with the
  tokenizer, into DIR (default RUN_DIR/export): what `nonstop sft` writes when it ends;
- with `--adapters`, a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
  into DIR (default RUN_DIR/adapters), which PEFT, transformers and vLLM load onto the base.
  `--with-base` also writes the base model (and tokenizer) into DIR/base. A base that was
  randomly initialised (a tiny or preset model) exists nowhere else, so it is always written.

    nonstop export runs/sft_lora --adapters
    python -c "import peft, transformers; base = transformers.AutoModelForCausalLM\\
        .from_pretrained('/ckpt/Qwen3-0.6B'); peft.PeftModel.from_pretrained(base, \\
        'runs/sft_lora/adapters')"

The export runs on one device, whatever mesh the run trained on. Do not export a run while it is
writing a checkpoint: opening its checkpoints removes unfinished (temporary) ones. Errors (no
run directory, no config.yaml, no checkpoint, `--adapters` on a run without LoRA) are one line
and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

CONFIG_RECORD = "config.yaml"  # what nonstop.recipes.run.start_run writes
CHECKPOINTS = "checkpoints"
SFT_ALGORITHMS = ("sft", "dpo", "orpo")


class ExportError(Exception):
    """What stops an export; printed as one line (exit status 2)."""


@dataclasses.dataclass
class RestoredRun:
    """A run's model at its latest checkpoint, and what exporting it needs."""

    model: Any  # a Decoder, with LoRA adapters if the run trained them
    tokenizer: Any
    step: int
    base_path: str | None  # where the base weights live on disk; None: randomly initialised
    dtype: Any  # the dtype the run exports in (None: the parameters' own)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export", help="write a run's model as a Hugging Face checkpoint or PEFT adapters",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a nonstop sft/dpo/orpo/rl run")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="output directory (default RUN_DIR/export, or RUN_DIR/adapters)")
    parser.add_argument("--adapters", action="store_true",
                        help="write the LoRA adapters in PEFT's format instead of a merged model")
    parser.add_argument("--with-base", action="store_true",
                        help="with --adapters: also write the base model into DIR/base")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from nonstop.models.safetensors_io import CheckpointError
    from nonstop.models.validation import ConfigError

    try:
        if args.with_base and not args.adapters:
            raise ExportError("--with-base goes with --adapters (a merged export is whole)")
        message = export(Path(args.run_dir), out=args.out and Path(args.out),
                         adapters=args.adapters, with_base=args.with_base)
    except (ExportError, ConfigError, CheckpointError, FileNotFoundError) as error:
        print(f"nonstop export: error: {error}", file=sys.stderr)
        return 2
    print(f"nonstop export: {message}")
    return 0


def export(run_dir: Path, *, out: Path | None = None, adapters: bool = False,
           with_base: bool = False) -> str:
    """Export as `nonstop export` does; returns the line it prints."""
    from nonstop.models.checkpoint import save_pretrained
    from nonstop.models.lora import merge_lora, strip_lora
    from nonstop.models.peft_format import save_adapters

    cfg = load_run_config(run_dir)
    if adapters and cfg.lora is None:
        raise ExportError(f"{run_dir}: the run trained full weights (its config.yaml has no lora)"
                          "; there are no adapters to export: drop --adapters for the whole model")
    restored = restore_run(run_dir, cfg)
    model = restored.model
    if not adapters:
        out = out or run_dir / "export"
        save_pretrained(merge_lora(model), out, dtype=restored.dtype)  # quantized ones too
        restored.tokenizer.save_pretrained(str(out))
        return f"{run_dir}: step {restored.step} merged into a Hugging Face checkpoint in {out}"
    out = out or run_dir / "adapters"
    base_path = restored.base_path
    wrote_base = with_base or base_path is None
    if wrote_base:
        base_path = str((out / "base").resolve())
    save_adapters(model, out, base_model_name_or_path=base_path)
    if wrote_base:
        # The adapters are saved; what remains is the base they were trained on.
        save_pretrained(merge_lora(strip_lora(model)), out / "base", dtype=restored.dtype)
        restored.tokenizer.save_pretrained(base_path)
    where = f" and the base model in {base_path}" if wrote_base else f" (base: {base_path})"
    return f"{run_dir}: step {restored.step} adapters in PEFT format in {out}{where}"


def load_run_config(run_dir: Path) -> Any:
    """The run's config (an `SFTRunConfig` or an `RLRunConfig`) from RUN_DIR/config.yaml."""
    import yaml

    from nonstop.models.validation import ConfigError
    from nonstop.recipes.config_io import load_config

    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    record = run_dir / CONFIG_RECORD
    if not record.is_file():
        raise ExportError(f"{record}: not found; RUN_DIR must be the run_dir of a nonstop "
                          "sft/dpo/orpo/rl run (it records config.yaml when it starts)")
    raw = yaml.safe_load(record.read_text()) or {}
    if not isinstance(raw, dict):
        raise ExportError(f"{record}: not a run config (the top level is not a mapping)")
    if raw.get("algorithm", "sft") in SFT_ALGORITHMS:
        from nonstop.sft.config import SFTRunConfig

        return load_config(SFTRunConfig, record)
    from nonstop.recipes.rl_recipe import RLRunConfig

    try:
        return load_config(RLRunConfig, record)
    except ConfigError as error:
        raise ExportError(f"{record}: neither a nonstop sft/dpo/orpo nor a nonstop rl run config "
                          f"({error})") from None


def restore_run(run_dir: Path, cfg: Any) -> RestoredRun:
    """The run's model rebuilt from its config, at its latest complete checkpoint."""
    from nonstop.sft.config import SFTRunConfig

    return (_restore_sft if isinstance(cfg, SFTRunConfig) else _restore_rl)(run_dir, cfg)


def _checkpointer(run_dir: Path, settings: Any) -> Any:
    """The run's checkpoint series; an error when it holds no complete checkpoint."""
    from nonstop.train.checkpoint import Checkpointer

    cfg = settings.in_run(run_dir, CHECKPOINTS)
    if not Path(cfg.directory).is_dir():
        raise ExportError(f"{run_dir}: no checkpoint: {cfg.directory} does not exist")
    checkpointer = Checkpointer(cfg)
    if checkpointer.latest_step() is None:
        checkpointer.close()
        raise ExportError(f"{run_dir}: no complete checkpoint in {cfg.directory}")
    return checkpointer


def _restore_sft(run_dir: Path, cfg: Any) -> RestoredRun:
    import numpy as np

    from nonstop.models.source import build_tokenizer
    from nonstop.sft import trainer
    from nonstop.sft.preference import policy_of

    with _checkpointer(run_dir, cfg.checkpoint) as checkpointer:
        tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
        model = trainer.build_train_model(cfg, tokenizer, mesh=None)
        restored = checkpointer.restore(trainer.create_state(cfg, model))
    return RestoredRun(model=policy_of(restored.state.model()), tokenizer=tokenizer,
                       step=restored.step, base_path=_abspath(cfg.model.path),
                       dtype=np.dtype(trainer.compute_dtype(cfg)))


def _restore_rl(run_dir: Path, cfg: Any) -> RestoredRun:
    from nonstop.models.source import build_tokenizer
    from nonstop.recipes.rl_recipe import build_task, initial_policy
    from nonstop.recipes.run import RunDirs
    from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig

    warm_dir = run_dir / "warmup_model"
    if cfg.warmup.steps and not (warm_dir / "config.json").is_file():
        raise ExportError(f"{run_dir}: the run warmed up its policy (warmup.steps="
                          f"{cfg.warmup.steps}) but {warm_dir} is missing")
    with _checkpointer(run_dir, cfg.checkpoint) as checkpointer:
        tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
        run = RunDirs(root=run_dir, own=run_dir)
        model = initial_policy(cfg, run, tokenizer, build_task(cfg.task), resuming=True)
        trainer = PolicyTrainer(model, PolicyTrainerConfig(
            algorithm=cfg.algorithm_config(), optimizer=cfg.optimizer, packing=cfg.packing,
            inner_epochs=cfg.inner_epochs, lora_only=cfg.lora is not None,
            critic_optimizer=cfg.critic_optimizer, seed=cfg.seed))
        restored = checkpointer.restore(trainer.state)
    base = warm_dir if cfg.warmup.steps else cfg.model.path
    return RestoredRun(model=restored.state.model(), tokenizer=tokenizer, step=restored.step,
                       base_path=_abspath(base), dtype=None)


def _abspath(path: str | Path | None) -> str | None:
    return None if path is None else str(Path(path).resolve())
