"""The Tunix side of `bench.rl_step`: the same single-turn GRPO workload through Google's Tunix
(`google-tunix` 0.1.7: `GRPOLearner` over an `RLCluster` with the vanilla rollout engine).

Run it with a Python that has google-tunix installed (it must not import nonstop: Tunix pins its
own jax); `python -m bench.rl_step --tunix-python PATH` runs it as a subprocess and reads the one
JSON object it prints last.

Workload (identical to bench/rl_step.py): a Qwen3 model (tunix.models.qwen3) with 4 layers, width
256, 4 heads of 64, 2 KV heads, feed-forward 512, vocabulary 1024, tied embeddings, random
initialisation, float32; per step 8 prompts of 8 random tokens x 4 samples, 64 new tokens at
temperature 0.9 (no end-of-sequence: the tokenizer's eos id is outside the vocabulary, so every
completion is 64 tokens, as on nonstop's side); SGD at 1e-3 (no momentum, no clipping); GRPO with
beta (KL coefficient) 0.04, clip 0.2, one iteration; reward the share of token TARGET_TOKEN in the
completion.

Timings: the RLCluster's `generate`, `get_ref_per_token_logps`, `get_old_per_token_logps`,
`update_actor` and `sync_weights` are wrapped with wall-clock timers that wait for their device
results (`update_actor` waits for the actor's parameters), so each part includes its device time.
A step is one call of the learner's `_run_global_step` plus what follows it up to the next one
(weight sync, metric buffering). The first `--warmup` steps (compiles) are not reported; compiles
after them are counted with jax.monitoring.

    /tmp/tunix-venv/bin/python bench/tunix_rl_step.py [--steps 10] [--warmup 3]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import sys
import time

NUM_PROMPTS, GROUP, PROMPT_TOKENS, NEW_TOKENS = 8, 4, 8, 64
VOCAB, TARGET_TOKEN, SEED = 1024, 7, 0
PARTS = ("rollout", "reference", "old_logprobs", "train", "weight_sync")


class TokenTokenizer:
    """Token i <-> the word `t{i}`; no bos; pad 0; eos outside the vocabulary (never sampled)."""

    def encode(self, text: str, **kwargs) -> list[int]:
        return [int(word[1:]) for word in text.split()]

    def decode(self, ids, **kwargs) -> str:
        return " ".join(f"t{int(i)}" for i in ids)

    def bos_id(self):
        return None

    def eos_id(self) -> int:
        return VOCAB

    def pad_id(self) -> int:
        return 0


def prompts_of(step: int) -> list[str]:
    """The step's prompts; bench/rl_step.py draws the same ones."""
    import numpy as np

    rng = np.random.default_rng([SEED, step])
    tokens = rng.integers(0, VOCAB, (NUM_PROMPTS, PROMPT_TOKENS))
    return [" ".join(f"t{int(t)}" for t in row) for row in tokens]


def token_share(prompts, completions, **kwargs) -> list[float]:
    out = []
    for text in completions:
        words = text.split()
        out.append(words.count(f"t{TARGET_TOKEN}") / max(len(words), 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    import jax
    import numpy as np
    import optax
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    compiles = [0]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.__setitem__(0, compiles[0] + 1)
        if event == "/jax/core/compile/backend_compile_duration" else None)

    cfg = qwen3.ModelConfig(num_layers=4, vocab_size=VOCAB, embed_dim=256, hidden_dim=512,
                            num_heads=4, head_dim=64, num_kv_heads=2, rope_theta=1_000_000,
                            norm_eps=1e-6, use_tied_embedding=True)
    # One device; Auto axes (jax.make_mesh would make them Explicit, which Tunix 0.1.7 rejects).
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    actor = qwen3.Qwen3(cfg, rngs=nnx.Rngs(SEED))  # the RLCluster places it on the mesh
    reference = qwen3.Qwen3(cfg, rngs=nnx.Rngs(SEED))
    total = args.warmup + args.steps
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=NEW_TOKENS, temperature=0.9, top_p=1.0, top_k=None,
        max_prompt_length=PROMPT_TOKENS, kv_cache_size=PROMPT_TOKENS + NEW_TOKENS + 8,
        eos_tokens=[VOCAB])
    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.sgd(1e-3), eval_every_n_steps=10**9, max_steps=total,
        pbar_description=None)
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=reference, tokenizer=TokenTokenizer(),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                          rl_cluster_lib.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False, training_config=training,
            rollout_config=rollout))
    algo = grpo_learner.GRPOConfig(num_generations=GROUP, num_iterations=1, beta=0.04,
                                   epsilon=0.2)
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo,
                                       reward_fns=token_share)

    # Timers: (part, step, seconds); step starts at each _run_global_step call.
    records: list[tuple[str, int, float]] = []
    step_starts: list[float] = []
    compiles_at_step: list[int] = []

    def timed(part: str, fn, wait):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            jax.block_until_ready(wait(out))
            records.append((part, len(step_starts) - 1, time.perf_counter() - t0))
            return out
        return wrapper

    def actor_params(_):
        return nnx.state(cluster.actor_trainer.model)

    cluster.generate = timed("rollout", cluster.generate, lambda out: out.tokens)
    cluster.get_ref_per_token_logps = timed("reference", cluster.get_ref_per_token_logps,
                                            lambda out: out)
    cluster.get_old_per_token_logps = timed("old_logprobs", cluster.get_old_per_token_logps,
                                            lambda out: out)
    cluster.update_actor = timed("train", cluster.update_actor, actor_params)
    cluster.sync_weights = timed("weight_sync", cluster.sync_weights, lambda out: None)
    global_step = learner._run_global_step

    def step_marker(*a, **kw):
        step_starts.append(time.perf_counter())
        compiles_at_step.append(compiles[0])
        return global_step(*a, **kw)

    learner._run_global_step = step_marker
    dataset = [{"prompts": np.asarray(prompts_of(step))} for step in range(total)]
    learner.train(dataset)
    end = time.perf_counter()
    compiles_end = compiles[0]

    bounds = step_starts + [end]
    rows = []
    for step in range(args.warmup, len(step_starts)):
        parts = collections.defaultdict(float)
        for part, s, seconds in records:
            if s == step:
                parts[part] += seconds
        rows.append({"step_s": bounds[step + 1] - bounds[step],
                     **{p: parts.get(p, 0.0) for p in PARTS}})
    if len(rows) < args.steps:
        sys.exit(f"tunix_rl_step: only {len(rows)} timed steps ran (expected {args.steps})")
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    generated = NUM_PROMPTS * GROUP * NEW_TOKENS
    print(json.dumps({
        "system": "tunix", "version": _version(), "jax": jax.__version__,
        "backend": jax.default_backend(), "steps": len(rows), "warmup": args.warmup,
        **{f"{k}_s": v for k, v in med.items() if k != "step_s"}, "step_s": med["step_s"],
        "tokens_per_s": generated / med["step_s"],
        "rollout_tokens_per_s": generated / med["rollout"] if med["rollout"] else None,
        "weight_sync_calls": sum(1 for p, s, _ in records
                                 if p == "weight_sync" and s >= args.warmup),
        "compiles_after_warmup": compiles_end - compiles_at_step[args.warmup],
        "steps_s": [r["step_s"] for r in rows]}))


def _version() -> str:
    from importlib.metadata import version

    return version("google-tunix")


if __name__ == "__main__":
    main()
