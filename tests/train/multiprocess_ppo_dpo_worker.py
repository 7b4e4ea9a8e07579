"""Worker of tests/train/test_multiprocess_ppo_dpo.py: PPO, KL-as-reward and precomputed DPO on
a global mesh of 4 CPU devices, as one process or as one of two.

    python -m tests.train.multiprocess_ppo_dpo_worker OUT --devices 4              # one process
    python -m tests.train.multiprocess_ppo_dpo_worker OUT --devices 2 --process-id I \\
        --num-processes 2 --port PORT                                              # one of two

Both layouts take the same steps on the same global batches, so their results must agree:
- PPO (`RLAlgorithmConfig.ppo()`: critic, GAE whitened over the step, k1 KL as a per-token
  reward penalty) trains on fixed scored trajectories for a few `train()` calls; each process
  passes only its own shard (its rows of the global batch), one process passes both.
- RLOO's `sequence_kl` (KL as an episode-level reward penalty) on uneven shards: process 0 holds
  three shards (3 batches), process 1 one (1 batch, padded with 2 empty reference passes).
- DPO with `reference: precomputed` through `nonstop.sft.trainer.train`: the collective
  reference pass, the cache written once by process 0, then SGD steps.
"""

from __future__ import annotations

import json
import os

from tests.train.multiprocess_worker import (
    REPO_ROOT,
    save_tree,
    shard_trajectories,
    start_worker,
)

SHARDS = 2  # PPO shards (one per process in the 2-process run)
PPO_STEPS = 3
SEQUENCE_KL_SHARDS = ((0, 2, 3), (1,))  # per process; one process holds all, in this order
PPO_STATS = ("advantage_mean_raw", "advantage_std_raw", "reward_kl", "loss", "value_loss")


def main() -> None:
    from nonstop.train import distributed

    out = start_worker()
    run_ppo(out)
    run_sequence_kl(out)
    run_dpo(out)
    distributed.barrier("worker done")


def scored_shard(shard: int, step: int) -> list:
    """`shard_trajectories` with fixed rewards (GAE reads the reward, not the advantage)."""
    episodes = shard_trajectories(shard, step)
    for i, t in enumerate(episodes):
        t.reward = float((shard + 2 * i + step) % 3) - 0.5
    return episodes


def sgd():
    from nonstop.train import OptimizerConfig

    # SGD, not AdamW: see tests/train/multiprocess_worker.py's run_grpo.
    return OptimizerConfig(name="sgd", learning_rate=0.3, schedule="constant", weight_decay=0.0)


def run_ppo(out: str) -> None:
    import jax

    from nonstop.models import ModelConfig, init_decoder
    from nonstop.rl import RLAlgorithmConfig
    from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
    from nonstop.train import PackingConfig, distributed

    mine = [jax.process_index()] if jax.process_count() > 1 else list(range(SHARDS))
    algorithm = RLAlgorithmConfig.ppo()
    assert algorithm.kl.mode == "reward" and algorithm.advantage.whiten
    cfg = PolicyTrainerConfig(
        algorithm=algorithm, optimizer=sgd(),
        packing=PackingConfig(buckets=(16,), rows_per_batch=2 * len(mine),
                              max_segments_per_row=4))
    trainer = PolicyTrainer(init_decoder(ModelConfig.tiny("qwen3", vocab_size=31), seed=0), cfg,
                            mesh=distributed.global_mesh(fsdp=4))
    save_tree(os.path.join(out, "ppo_initial.npz"), trainer.state.params)
    save_tree(os.path.join(out, "critic_initial.npz"), trainer.critic.state.params)
    stats = []
    for k in range(PPO_STEPS):
        metrics = trainer.train([t for s in mine for t in scored_shard(s, k)])
        if metrics["optimizer_steps"] != 1:
            raise AssertionError(f"expected one optimizer step per train(), got {metrics}")
        stats.append({name: metrics[name] for name in PPO_STATS})
    save_tree(os.path.join(out, "ppo_params.npz"), trainer.state.params)
    save_tree(os.path.join(out, "critic_params.npz"), trainer.critic.state.params)
    if distributed.is_main_process():
        with open(os.path.join(out, "ppo.json"), "w") as f:
            json.dump(stats, f)


def run_sequence_kl(out: str) -> None:
    """Each process's per-episode KL sums, written as sequence_kl_{process}.npy."""
    import jax
    import numpy as np

    from nonstop.models import ModelConfig, init_decoder
    from nonstop.rl import RLAlgorithmConfig
    from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
    from nonstop.train import PackingConfig, distributed

    processes = jax.process_count()
    shards = (SEQUENCE_KL_SHARDS[jax.process_index()] if processes > 1
              else [s for block in SEQUENCE_KL_SHARDS for s in block])
    algorithm = RLAlgorithmConfig.rloo()
    assert algorithm.kl.mode == "reward" and algorithm.advantage.estimator == "rloo"
    cfg = PolicyTrainerConfig(
        algorithm=algorithm, optimizer=sgd(),
        packing=PackingConfig(buckets=(16,), rows_per_batch=4 // processes,
                              max_segments_per_row=4))
    trainer = PolicyTrainer(init_decoder(ModelConfig.tiny("qwen3", vocab_size=31), seed=1), cfg,
                            mesh=distributed.global_mesh(fsdp=4))
    episodes = [t for s in shards for t in shard_trajectories(s, 100)]
    np.save(os.path.join(out, f"sequence_kl_{jax.process_index()}.npy"),
            trainer.sequence_kl(episodes))


def run_dpo(out: str) -> None:
    from nonstop.cli.sft import load_run_config
    from nonstop.recipes.sft_data import prepare_run
    from nonstop.sft.trainer import train
    from nonstop.train import distributed

    config = os.path.join(REPO_ROOT, "nonstop", "recipes", "configs", "dpo_tiny.yaml")
    overrides = [f"run_dir={os.path.join(out, 'dpo')}", "reference=precomputed", "steps=3",
                 "model.hidden_size=44", "model.intermediate_size=52", "model.num_layers=1",
                 "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=8",
                 "builtin_data.num_train=20", "builtin_data.num_eval=4", "packing.buckets=[128]",
                 "packing.rows_per_batch=8", "metrics.progress_bar=false",
                 "metrics.tensorboard=false", "mesh.fsdp=4", "optimizer.name=sgd",
                 "optimizer.learning_rate=0.5", "optimizer.weight_decay=0.0",
                 "optimizer.schedule=constant", "optimizer.warmup_steps=0",
                 "checkpoint.async_save=false", "export=false"]
    cfg, tokenizer = prepare_run(load_run_config("dpo", config, overrides))
    result = train(cfg, tokenizer=tokenizer)
    save_tree(os.path.join(out, "dpo_params.npz"), result.state.params)
    if distributed.is_main_process():
        with open(os.path.join(out, "dpo.json"), "w") as f:
            json.dump({"last_step": result.last_step, "loss": result.last_metrics["loss"]}, f)


if __name__ == "__main__":
    main()
