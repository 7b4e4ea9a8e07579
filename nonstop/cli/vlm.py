"""`nonstop vlm --config NAME|FILE.yaml [key.sub=value ...]`: SFT or DPO of a Gemma 3
vision-language model, with LoRA on the language model (and, with vision_lora=true, on the
vision attention).

The config is a `VisionTrainConfig` (nonstop/sft/vision_trainer.py) read from YAML, then the
dotted overrides in order; `kind` (sft or dpo) chooses the objective. The tokenizer and the image
processor come from the checkpoint directory (tokenizer_path=... to use another tokenizer).
`nonstop configs` lists the shipped configs (the vlm_* ones run here); `--config` takes one's
name or a YAML file:

    nonstop vlm --config vlm_sft_gemma3_4b \\
        model_path=/ckpt/gemma-3-4b-it data_path=/data/captions.jsonl run_dir=runs/vlm

Data is JSONL: {"prompt": "...<start_of_image>...", "completion": ..., "images": ["a.png"]} or
{"messages": [...]} with {"type": "image", "path": ...} content blocks for sft,
{"prompt", "chosen", "rejected", "images"} for dpo; image paths are relative to the JSONL file.

`mesh.data`, `mesh.fsdp` and `mesh.tp` train on a device mesh (batch_size and max_images
multiples of data x fsdp); under jax.distributed (NONSTOP_COORDINATOR_ADDRESS,
NONSTOP_NUM_PROCESSES and NONSTOP_PROCESS_ID, or NONSTOP_DISTRIBUTED=auto) every process runs the
same command and the mesh covers all of their devices, as for `nonstop sft` (docs/scaling.md).

A run directory records the resolved config (config.yaml), metrics (metrics.jsonl,
tensorboard/; RUN_DIR/process_N for the other processes), the data lines each step trained on
(examples.jsonl), the perf trace, Orbax checkpoints (checkpoints/: adapters, optimizer state,
step, RNG and data cursor, every checkpoint.save_every steps and after the last) and, at the
end, export/ (a Hugging Face checkpoint with the tokenizer and preprocessor_config.json).
SIGTERM checkpoints the current step and exits with status 143; running the same command again,
or `nonstop vlm --resume RUN_DIR`, continues from the latest checkpoint exactly as if never
stopped. Bad input — an unknown key, a bad value, a malformed data line, a
missing or unreadable image, an example longer than seq_len, a mesh the batch or the devices do
not fit — stops the run with a message naming the key or the file and line (exit status 2).
"""

from __future__ import annotations

import argparse
import sys

from nonstop.cli.config_command import (
    add_config_command,
    load_or_report,
    print_config,
    report_error,
)

STOPPED_EXIT = 128 + 15  # stopped by SIGTERM, checkpoint written
COMMAND = "nonstop vlm"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `vlm` on the top-level CLI's subparsers."""
    return add_config_command(subparsers, "vlm", help="SFT or DPO of a Gemma 3 vision-language "
                              "model (LoRA)", description=__doc__,
                              config_class="nonstop.sft.vision_trainer:VisionTrainConfig",
                              run=run, resume=True)


def run(args: argparse.Namespace) -> int:
    """Train as configured; returns the process exit code."""
    # Imported here so that `nonstop vlm --help` does not pay for JAX.
    from nonstop.recipes.learner_state import TerminationGuard
    from nonstop.recipes.run import start_run
    from nonstop.sft.vision_trainer import CHECKPOINT_DIR, VisionTrainConfig, train_vision

    cfg = load_or_report(VisionTrainConfig, args, COMMAND)
    if cfg is None:
        return 2
    if args.print_config:
        return print_config(cfg)
    try:
        start_run(cfg, cfg.run_dir)
        with TerminationGuard() as guard:
            result = train_vision(cfg, stop_requested=lambda: guard.requested)
    except (ValueError, TypeError, KeyError, FileNotFoundError) as error:
        # ValueError covers ConfigError, CheckpointError, VisionDataError and ImageError.
        return report_error(COMMAND, error)
    if result.stopped:
        saved = cfg.checkpoint.in_run(cfg.run_dir, CHECKPOINT_DIR).directory
        print(f"{COMMAND}: stopped by SIGTERM after step {result.last_step} of {cfg.steps}; "
              f"checkpoint written to {saved}. Run the same command again to resume",
              file=sys.stderr)
        return STOPPED_EXIT
    loss = f"{result.losses[-1]:.4g}" if result.losses else "n/a"
    resumed = f" (resumed after step {result.start_step})" if result.start_step else ""
    print(f"{COMMAND} ({cfg.kind}): {result.run_dir}: {len(result.losses)} steps{resumed}, "
          f"loss {loss}"
          + (f", exported to {result.export_dir}" if result.export_dir else ""))
    return 0
