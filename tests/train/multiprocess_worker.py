"""Worker of tests/train/test_multiprocess.py: SFT and GRPO steps on a global mesh of 4 CPU devices.

    python -m tests.train.multiprocess_worker OUT --devices 4                   # one process
    python -m tests.train.multiprocess_worker OUT --devices 2 --process-id I \\
        --num-processes 2 --port PORT                                          # one of two

Both layouts take the same steps on the same global batches, so their parameters must agree:
- SFT: `nonstop.sft.trainer.train` for 2 steps (checkpointing every step), then again to step 4,
  which restores the step-2 checkpoint collectively and resumes the data iterator; the final
  parameters and the export are written by process 0.
- `nonstop rl` and `nonstop agentic` (streaming learner, max_staleness 0) end to end: each
  process rolls out its share of every step's prompts/groups on its own engine; the agentic
  run stops after one step and resumes.
- GRPO: `PolicyTrainer(mesh=global_mesh)` (with its KL to the reference policy) trains on fixed
  trajectories with SGD with momentum. The step's trajectories are two shards, each packing into
  2 rows; with two processes each passes only its own shard to `train()` (its rows of the global
  batch), with one process both shards pack into the same 4 rows.
"""

from __future__ import annotations

import argparse
import json
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARDS = 2  # trajectory shards of the GRPO global batch (one per process in the 2-process run)
GRPO_STEPS = 3


def start_worker() -> str:
    """Parse a worker's command line (OUT, --devices, --process-id, --num-processes, --port),
    force its CPU devices, create OUT and join `jax.distributed` if it is one of several.
    Returns OUT. Shared by every multi-process test worker."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    # Before jax is imported: the device count is read once, when the CPU backend starts.
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.makedirs(args.out, exist_ok=True)

    from nonstop.train import distributed

    cfg = None
    if args.num_processes > 1:
        cfg = distributed.DistributedConfig(
            coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.num_processes,
            process_id=args.process_id, initialization_timeout_s=60)
    distributed.initialize(cfg)
    return args.out


def main() -> None:
    from nonstop.train import distributed

    out = start_worker()
    run_sft(out)
    run_grpo(out)
    run_rl_recipe(out)
    run_agentic_recipe(out)
    distributed.barrier("worker done")


def save_tree(path: str, tree: object) -> None:
    """Every process gathers (a collective); process 0 writes {keystr: array}."""
    import jax
    import numpy as np

    from nonstop.train import distributed

    host = distributed.fetch(tree)
    if distributed.is_main_process():
        flat = jax.tree_util.tree_flatten_with_path(host)[0]
        np.savez(path, **{jax.tree_util.keystr(p): np.asarray(x) for p, x in flat})


def run_sft(out: str) -> None:
    from nonstop.cli.sft import load_run_config
    from nonstop.recipes.sft_data import prepare_run
    from nonstop.sft.trainer import train
    from nonstop.train import distributed

    config = os.path.join(REPO_ROOT, "nonstop", "recipes", "configs", "sft_tiny.yaml")
    common = [f"run_dir={os.path.join(out, 'sft')}", "model.hidden_size=44",
              "model.intermediate_size=52", "model.num_heads=4", "model.num_kv_heads=2",
              "model.head_dim=8", "builtin_data.num_train=64", "builtin_data.num_eval=8",
              "metrics.progress_bar=false", "metrics.tensorboard=false", "mesh.fsdp=4",
              "optimizer.schedule=constant", "optimizer.warmup_steps=0",
              "checkpoint.save_every=1", "checkpoint.async_save=false"]
    first, tokenizer = prepare_run(load_run_config("sft", config, [*common, "steps=2",
                                                                   "export=false"]))
    train(first, tokenizer=tokenizer)
    resumed, tokenizer = prepare_run(load_run_config("sft", config, [*common, "steps=4"]))
    result = train(resumed, tokenizer=tokenizer)
    save_tree(os.path.join(out, "sft_params.npz"), result.state.params)
    if distributed.is_main_process():
        with open(os.path.join(out, "sft.json"), "w") as f:
            json.dump({"start_step": result.start_step, "last_step": result.last_step,
                       "export_dir": result.export_dir}, f)


def shard_trajectories(shard: int, step: int) -> list:
    """Four fixed episodes (two groups of two) for one shard of one step."""
    import numpy as np

    from nonstop.rl.trajectory import Trajectory

    rng = np.random.default_rng(1000 * step + shard)
    episodes = []
    for i in range(4):
        prompt = rng.integers(1, 31, size=3).tolist()
        completion = rng.integers(1, 31, size=3).tolist()
        t = Trajectory.from_completion(prompt, completion, (-rng.uniform(0.5, 3.0, 3)).tolist(),
                                       [0] * 3, group_id=10 * shard + i // 2, episode_id=i)
        t.advantage = float(rng.normal())
        episodes.append(t)
    return episodes


def run_grpo(out: str) -> None:
    import jax

    from nonstop.models import ModelConfig, init_decoder
    from nonstop.rl import RLAlgorithmConfig
    from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
    from nonstop.train import OptimizerConfig, PackingConfig, distributed

    # This process's shards: its own with several processes, all of them with one; each shard
    # packs into 2 rows, so `rows_per_batch` (rows per process) is 2 per shard held.
    mine = ([jax.process_index()] if jax.process_count() > 1 else list(range(SHARDS)))
    cfg = PolicyTrainerConfig(
        algorithm=RLAlgorithmConfig.grpo(),
        # SGD with momentum, not AdamW: Adam's first steps are about lr * sign(g), so gradient
        # components within float noise of zero (the KL term at ratio 1, for one) flip by ~lr
        # under any change of reduction order, one process or two alike.
        optimizer=OptimizerConfig(name="sgd", learning_rate=0.3, schedule="constant",
                                  weight_decay=0.0),
        packing=PackingConfig(buckets=(16,), rows_per_batch=2 * len(mine),
                              max_segments_per_row=4))
    trainer = PolicyTrainer(init_decoder(ModelConfig.tiny("qwen3", vocab_size=31), seed=0), cfg,
                            mesh=distributed.global_mesh(fsdp=4))
    save_tree(os.path.join(out, "grpo_initial.npz"), trainer.state.params)
    losses = []
    for k in range(GRPO_STEPS):
        metrics = trainer.train([t for s in mine for t in shard_trajectories(s, k)])
        if metrics["optimizer_steps"] != 1:
            raise AssertionError(f"expected one optimizer step per train(), got {metrics}")
        losses.append(metrics["loss"])
    save_tree(os.path.join(out, "grpo_params.npz"), trainer.state.params)
    if distributed.is_main_process():
        with open(os.path.join(out, "grpo.json"), "w") as f:
            json.dump({"losses": losses}, f)


def run_rl_recipe(out: str) -> None:
    """`nonstop rl` end to end: 4 prompts x 4 samples per step; with two processes each rolls
    out 2 prompts on its own engine and packs them into its 2 rows of the global batch."""
    import jax

    from nonstop.recipes.config_io import load_config
    from nonstop.recipes.rl_recipe import RLRunConfig, run_rl

    processes = jax.process_count()
    cfg = load_config(RLRunConfig, os.path.join(REPO_ROOT, "nonstop/recipes/configs/"
                                                 "grpo_arithmetic.yaml"), [
        f"run_dir={os.path.join(out, 'rl')}", "steps=2", "eval_every=2", "warmup.steps=0",
        "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
        "model.head_dim=8", "task.num_eval=8", "rollout.group_size=4",
        f"rollout.prompts_per_step={4 // processes}", "rollout.max_new_tokens=4",
        "engine.max_slots=16", "engine.max_len=32", "packing.buckets=[128]",
        f"packing.rows_per_batch={4 // processes}", "optimizer.name=sgd",
        "optimizer.learning_rate=0.3", "checkpoint.save_every=100"])
    run_rl(cfg, progress=False)


def run_agentic_recipe(out: str, rollout=None) -> None:
    """`nonstop agentic` end to end from the calculator SFT fixture: 4 groups x 4 episodes per
    step with the streaming learner at max_staleness 0; with two processes each runs 2 groups
    on its own engine and environments (or, given `rollout`, on that backend) and packs them
    into its 8 rows of the global batch. The run stops after step 1 and resumes to step 2."""
    import dataclasses

    import jax

    from nonstop.models import load_pretrained
    from nonstop.recipes.agentic_recipe import run_agentic
    from nonstop.recipes.demo import DemoConfig
    from nonstop.train import OptimizerConfig, PackingConfig

    processes = jax.process_count()
    demo = DemoConfig(run_dir=os.path.join(out, "agentic_demo"), rl_steps=2, max_staleness=0,
                      progress=False)
    base = demo.agentic()
    cfg = dataclasses.replace(
        base, run_dir=os.path.join(out, "agentic"), learner="streaming",
        groups_per_step=4, group_size=4, num_eval=4, max_concurrency=16,
        rollout=rollout or base.rollout,
        optimizer=OptimizerConfig(name="sgd", learning_rate=0.05, schedule="constant",
                                  weight_decay=0.0),
        packing=PackingConfig(buckets=(320,), rows_per_batch=16 // processes,
                              max_segments_per_row=2, overlong="truncate"))
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, max_slots=16))
    fixture = os.path.join(REPO_ROOT, "tests", "fixtures", "calculator_sft")
    # One step, then the same run to two: the second call resumes from the first's checkpoint
    # (every process's pending groups regenerated by the process that drew them).
    run_agentic(dataclasses.replace(cfg, steps=1), model=load_pretrained(fixture),
                progress=False)
    run_agentic(cfg, model=load_pretrained(fixture), progress=False)


if __name__ == "__main__":
    main()
