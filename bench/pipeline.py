"""Streaming vs synchronous learner benchmark (docs/benchmarks.md): agentic GRPO end to end.

Model: bench.agentic's (random Qwen3-style, 2 layers, width 128, vocab 256, tied, float32), one
copy in the engine and one in the trainer. GRPO (no KL; token-level TIS against the behaviour
log-probs), G = 4 episodes per prompt, 4 prompts per step. Episodes have heavy-tailed lengths:
the turn count is geometric (p = 1/2) truncated to 1-6, 16 tokens per turn, and after every turn
but the last a tool whose latency is log-normal with mean 200 ms (sigma 1) returns 4 tokens.
Reward: the fraction of answer tokens in the lower half of the vocabulary (learnable).
Modes: the synchronous learner (collect the step's groups, train, push weights) and the
streaming learner with max_staleness 0, 1 and 4 (weights pushed every step).
Figures: optimizer steps/s, trainer idle fraction (1 - trainer device-busy / wall), engine busy
fraction, staleness histogram, and the reward after the fixed number of steps (mean over 64
evaluation episodes with the final weights, the same episodes for every mode; tools instant).
Every mode starts from the same weights; the train step is compiled before any is timed.

    python -m bench.pipeline [--out results.jsonl] [--quick] [--steps 30] [--repeats 3]
                             [--correction tis|decoupled|sequence_mask|none]
                             [--modes sync0 streaming0 streaming1 streaming4]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.agentic import model_config
from nonstop import perf
from nonstop.agentic.agent import derive_seed
from nonstop.agentic.config import AgentConfig, OrchestratorConfig, StreamingLearnerConfig
from nonstop.agentic.orchestrator import EpisodeSpec, RolloutOrchestrator
from nonstop.agentic.streaming import StreamingLearner, SyncLearner
from nonstop.agentic.trajectory_builder import ScriptedToolInteraction
from nonstop.engine import Engine, EngineConfig, SamplingParams, gc_heap_frozen
from nonstop.models import init_decoder
from nonstop.rl import KLConfig, OffPolicyConfig, RLAlgorithmConfig
from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
from nonstop.rl.trajectory import Trajectory
from nonstop.train import OptimizerConfig, PackingConfig

G, PROMPTS_PER_STEP, TURN_TOKENS, TOOL_TOKENS, MAX_TURNS = 4, 4, 16, 4, 6
AGENT = AgentConfig(max_turns=MAX_TURNS, max_tokens_per_turn=TURN_TOKENS, ignore_eos=True)
MODES = (("sync", 0), ("streaming", 0), ("streaming", 1), ("streaming", 4))


def algorithm(correction: str = "tis") -> RLAlgorithmConfig:
    base = RLAlgorithmConfig.grpo()
    loss = dataclasses.replace(base.policy_loss, kl=KLConfig(coef=0.0),
                               off_policy=OffPolicyConfig(correction=correction, weight_cap=2.0))
    return dataclasses.replace(base, policy_loss=loss)


def factory(vocab: int, tool_latency: bool):
    def make(spec: EpisodeSpec) -> ScriptedToolInteraction:
        rng = np.random.default_rng(derive_seed(5, spec.group_id, spec.index))
        turns = min(int(rng.geometric(0.5)), MAX_TURNS)
        latencies = rng.lognormal(math.log(0.2) - 0.5, 1.0, MAX_TURNS)

        async def tool(turn: int, sampled) -> list[int]:
            if tool_latency:
                await asyncio.sleep(float(latencies[turn - 1]))
            return [(t * 3 + turn) % vocab for t in sampled[:TOOL_TOKENS]]

        prompt = np.random.default_rng(derive_seed(6, spec.group_id)).integers(0, vocab, 8)
        return ScriptedToolInteraction(prompt.tolist(), num_turns=turns, tool=tool,
                                       reward_fn=lambda a: float(np.mean(np.asarray(a)
                                                                         < vocab // 2)))

    return make


def learner_config(max_staleness: int, concurrency: int, seed: int) -> StreamingLearnerConfig:
    return StreamingLearnerConfig(groups_per_step=PROMPTS_PER_STEP, max_staleness=max_staleness,
                         sync_every=1, orchestrator=OrchestratorConfig(
                             group_size=G, max_concurrency=concurrency, seed=seed, agent=AGENT))


def evaluate(engine: Engine, vocab: int) -> float:
    """Mean reward of 64 fixed evaluation episodes (group ids 10**6...) with the engine's weights."""
    config = OrchestratorConfig(group_size=G, max_concurrency=64, seed=12345, agent=AGENT)
    orchestrator = RolloutOrchestrator(engine, factory(vocab, tool_latency=False), config)
    groups = asyncio.run(orchestrator.run_groups(range(10**6, 10**6 + 16)))
    return float(np.mean([t.reward for g in groups.values() for t in g]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--slots", type=int, default=None)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--correction", default="tis",
                        choices=("tis", "decoupled", "sequence_mask", "none"),
                        help="the off-policy correction (OffPolicyConfig.correction)")
    parser.add_argument("--modes", nargs="+", default=[f"{k}{s}" for k, s in MODES],
                        choices=[f"{k}{s}" for k, s in MODES],
                        help="which learners to run (sync is always run: the baseline)")
    args = parser.parse_args()
    steps = args.steps or (8 if args.quick else 30)
    repeats = args.repeats or (1 if args.quick else 3)
    slots = args.slots or (16 if args.quick else 32)
    cfg = model_config("small")
    vocab = cfg.vocab_size
    model = init_decoder(cfg, seed=0)
    graphdef, state = nnx.split(model)
    trainer = PolicyTrainer(nnx.merge(graphdef, jax.tree.map(jnp.copy, state)), PolicyTrainerConfig(
        algorithm=algorithm(args.correction),
        optimizer=OptimizerConfig(learning_rate=args.learning_rate, schedule="constant",
                                  weight_decay=0.0),
        packing=PackingConfig(buckets=(128,), rows_per_batch=G * PROMPTS_PER_STEP,
                              max_segments_per_row=8)))
    engine_params = jax.tree.map(jnp.copy, nnx.state(model))
    max_len = 8 + MAX_TURNS * TURN_TOKENS + (MAX_TURNS - 1) * TOOL_TOKENS + 4
    engine = Engine(model, EngineConfig(max_slots=slots, max_len=max_len, prefill_chunks=(16, 64))).start()

    # Compile the train step (and the group scoring) before anything is timed.
    warm = []
    for i in range(G * PROMPTS_PER_STEP):
        t = Trajectory.from_completion([1, 2, 3], [4, 5, 6], [-1.0] * 3, [0] * 3, group_id=0,
                                       episode_id=i)
        t.advantage = 1.0 if i % 2 else -1.0
        warm.append(t)
    initial_state = jax.tree.map(jnp.copy, trainer.state)
    trainer.train(warm)
    initial_eval = evaluate(engine, vocab)
    print(f"slots={slots} max_concurrency={args.max_concurrency} steps={steps} "
          f"repeats={repeats} G={G} prompts/step={PROMPTS_PER_STEP} "
          f"correction={args.correction}; reward before training "
          f"{initial_eval:.3f}")
    print(f"{'mode':>14} {'steps/s':>8} {'trainer idle':>12} {'engine busy':>11} "
          f"{'reward':>7} {'compiles':>8}  staleness histogram")
    rows, by_mode = [], {}
    modes = [(k, s) for k, s in MODES if k == "sync" or f"{k}{s}" in args.modes]
    for kind, staleness in modes:
        runs = []
        for rep in range(repeats):
            trainer.state = jax.tree.map(jnp.copy, initial_state)
            trainer.steps_taken = 0
            engine.update_weights(engine_params, version=0)
            engine.generate_sync([1], SamplingParams(max_tokens=1))
            cls = SyncLearner if kind == "sync" else StreamingLearner
            learner = cls(trainer, engine, factory(vocab, tool_latency=True),
                          learner_config(staleness, args.max_concurrency, seed=rep))
            perf.configure(perf.PerfConfig(capacity=4_000_000))
            traces = sum(engine.stats().traces.values())

            async def go(learner=learner):
                with perf.span("bench/run") as window:
                    t0 = time.perf_counter()
                    records = await learner.run(steps)
                    return records, time.perf_counter() - t0, window.id

            with gc_heap_frozen():  # as `nonstop agentic` trains
                records, wall, window_id = asyncio.run(go())
            events = perf.current().events()
            w = next(e for e in events if e.id == window_id)
            window = (w.t0, w.t1)
            runs.append({
                "steps_per_s": steps / wall, "wall_s": wall,
                "trainer_idle": 1.0 - perf.busy_fraction(events, perf.TRAINER, window),
                "engine_busy": perf.busy_fraction(events, perf.ENGINE, window),
                "reward": evaluate(engine, vocab),
                "train_reward_last": records[-1].reward_mean,
                "compiles_after_warmup": sum(engine.stats().traces.values()) - traces,
                "staleness": collections.Counter(s for r in records for s in r.staleness)})
        name = f"{kind}" + ("" if kind == "sync" else f"(s={staleness})")
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "staleness"}
        hist = sum((r["staleness"] for r in runs), collections.Counter())
        by_mode[name] = med
        print(f"{name:>14} {med['steps_per_s']:8.3f} {med['trainer_idle']:12.2f} "
              f"{med['engine_busy']:11.2f} {med['reward']:7.3f} "
              f"{med['compiles_after_warmup']:8.0f}  {dict(sorted(hist.items()))}")
        rows.append({"benchmark": "pipeline", "mode": kind, "max_staleness": staleness,
                     "correction": args.correction,
                     "steps": steps, "repeats": repeats, "slots": slots,
                     "max_concurrency": args.max_concurrency, "initial_reward": initial_eval,
                     "staleness_histogram": {str(k): v for k, v in sorted(hist.items())},
                     **med})
    base = by_mode["sync"]
    for name, med in by_mode.items():
        if name != "sync":
            print(f"{name:>14} / sync: steps/s x{med['steps_per_s'] / base['steps_per_s']:.2f}, "
                  f"reward {med['reward'] - base['reward']:+.3f}")
    engine.stop()
    if args.out:
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
