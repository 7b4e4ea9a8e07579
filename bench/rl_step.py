"""Single-turn GRPO step benchmark (docs/benchmarks.md): nonstop's batch learner against Google's
Tunix on the same workload, side by side in one run, and where nonstop's step time goes.

Workload (the same on both sides): a random Qwen3-style decoder, 4 layers, width 256, 4 heads of
64, 2 KV heads, feed-forward 512, vocabulary 1024, tied embeddings, float32; per step 8 prompts
of 8 random tokens (the same prompts on both sides) x 4 samples, exactly 64 new tokens at
temperature 0.9 (no end-of-sequence token exists); plain SGD at 1e-3 (no momentum, no clipping);
GRPO (`RLAlgorithmConfig.grpo()`: group-normalised advantages, clip 0.2, k3 KL to the initial
policy in the loss with coefficient 0.04, one optimizer pass); reward: the share of token 7 in
the completion.

nonstop's side is the `Learner` of `nonstop rl` (nonstop/recipes/rl_recipe.py) over an `Engine`
and a `PolicyTrainer`; each step is `Learner.train_step()`: rollout of all 32 completions,
rewards and advantages, packing, the reference log-prob pass, the optimizer step(s), the weight
push to the engine. Its parts come from nonstop's perf spans (`rollout/queue_wait`,
`rollout/reward`, `train/data_wait`, `train/step`, `train/weight_sync`); the trainer's log-prob
pass is wrapped to wait for its result, so the reference pass is not counted inside the train
step that waits on it. Tunix's side (bench/tunix_rl_step.py) runs in its own Python
(`--tunix-python`, or `--make-tunix-env DIR` builds one) as a subprocess; repetitions alternate
the two sides. nonstop's steps run inside `gc_heap_frozen()`, as `nonstop rl` runs its learner. Medians over the timed steps, then over repetitions; compiles after warm-up are
counted. `--profile DIR` adds a breakdown of nonstop's step (jax.profiler trace, packing fill,
isolated pass times, donation warnings, host round trips).

    python -m bench.rl_step [--tunix-python /tmp/tunix-venv/bin/python] [--quick] [--steps 10]
                            [--warmup 3] [--repeats 3] [--profile DIR] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tokenizers

from bench.agentic import model_config
from bench.tunix_rl_step import (
    GROUP,
    NEW_TOKENS,
    NUM_PROMPTS,
    PARTS,
    PROMPT_TOKENS,
    TARGET_TOKEN,
    VOCAB,
    prompts_of,
)
from nonstop import perf
from nonstop.engine import Engine, EngineConfig, SamplingParams, gc_heap_frozen
from nonstop.models import Tokenizer, init_decoder
from nonstop.rl import RLAlgorithmConfig
from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
from nonstop.rl.rewards import Example, Reward
from nonstop.train import OptimizerConfig, PackingConfig

try:
    from nonstop.rl.learner import BatchLearnerConfig, Learner, RolloutConfig
except ImportError as missing:  # single-turn RL moving onto agentic.single_turn's learner
    raise SystemExit(
        "bench.rl_step measures nonstop.rl.learner.Learner (the batch learner), which this "
        "checkout does not have; build the step from agentic.single_turn.PromptEpisodes and "
        "agentic.streaming.StreamingLearner as nonstop/recipes/rl_recipe.py does, and time each "
        "step from its on_step records") from missing

TUNIX_VERSION = "0.1.7"
MODES = {"staleness0": None,
         "staleness1": "not implemented yet: single-turn RL has only the batch learner "
                       "(staleness 0); the streaming learner exists for agentic RL only",
         "staleness2": "not implemented yet: single-turn RL has only the batch learner "
                       "(staleness 0); the streaming learner exists for agentic RL only"}
STEP_SPAN = "bench/rl_step"


def token_tokenizer() -> Tokenizer:
    """Token i <-> the word `t{i}`, no special tokens (so no end-of-sequence: 64 tokens each)."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend)


def token_share(prompt: str, completion: str, example: Example) -> float:
    words = completion.split()
    return words.count(f"t{TARGET_TOKEN}") / max(len(words), 1)


def examples() -> Any:
    """Step s's 8 prompts, the ones bench/tunix_rl_step.py feeds Tunix at its step s."""
    step = 0
    while True:
        for i, prompt in enumerate(prompts_of(step)):
            yield Example(prompt=prompt, answer="", id=f"{step}/{i}")
        step += 1


@dataclasses.dataclass
class Setup:
    learner: Learner
    trainer: PolicyTrainer
    engine: Engine


def build(args: argparse.Namespace) -> Setup:
    cfg = model_config("large")  # 4 layers, width 256, vocab 1024, tied, float32
    assert cfg.vocab_size == VOCAB
    model = init_decoder(cfg, seed=0)
    packing = PackingConfig(buckets=tuple(args.buckets), rows_per_batch=args.rows,
                            max_segments_per_row=args.max_segments)
    optimizer = OptimizerConfig(name="sgd", learning_rate=1e-3, b1=0.0, schedule="constant",
                                weight_decay=0.0, max_grad_norm=None)
    trainer = PolicyTrainer(model, PolicyTrainerConfig(
        algorithm=RLAlgorithmConfig.grpo(), optimizer=optimizer, packing=packing, seed=0))
    engine = Engine(trainer.model(), EngineConfig(
        max_slots=NUM_PROMPTS * GROUP, max_len=PROMPT_TOKENS + NEW_TOKENS,
        prefill_chunks=(PROMPT_TOKENS,), prefill_rows=args.prefill_rows,
        decode_steps_per_call=args.decode_steps))
    rollout = RolloutConfig(group_size=GROUP, prompts_per_step=NUM_PROMPTS,
                            max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=0.9))
    learner = Learner(trainer, engine, token_tokenizer(), examples(),
                      Reward("token_share", token_share),
                      BatchLearnerConfig(rollout=rollout, steps=10**9, max_sampling_rounds=0))
    wait_for_logprobs(trainer)
    return Setup(learner, trainer, engine)


def wait_for_logprobs(trainer: PolicyTrainer) -> None:
    """Make the trainer's log-prob pass wait for its result, so its device time lands in its own
    span (`train/data_wait`) instead of in the optimizer step that would wait for it."""
    jitted = trainer._logprobs

    def waiting(*args: Any) -> jax.Array:
        return jax.block_until_ready(jitted(*args))

    trainer._logprobs = waiting


class CompileCounter:
    def __init__(self) -> None:
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


async def run_steps(learner: Learner, n: int) -> None:
    for _ in range(n):
        with perf.span(STEP_SPAN, step=learner.step):
            await learner.train_step()


def step_parts(events_path: Path, first_step: int) -> list[dict[str, float]]:
    """Per timed step (STEP_SPAN with step >= first_step): wall time and its parts, seconds."""
    log = perf.read_events(str(events_path))
    spans = [e for e in log.events if e.ph == "X"]
    steps = sorted((e for e in spans if e.name == STEP_SPAN and e.tags["step"] >= first_step),
                   key=lambda e: e.t0)
    rows = []
    for s in steps:
        inner = [e for e in spans if e.t0 >= s.t0 and e.t1 <= s.t1 and e is not s]

        def total(name: str, stage: str | None = None, inner=inner) -> float:
            return sum(e.duration_ns for e in inner if e.name == name
                       and (stage is None or e.tags.get("stage") == stage)) / 1e9

        row = {"step_s": s.duration_ns / 1e9,
               "rollout": total(perf.ROLLOUT_QUEUE_WAIT, "collect"),
               "reward": total(perf.ROLLOUT_REWARD),
               "reference": total(perf.TRAIN_DATA_WAIT, "logprobs"),
               "old_logprobs": 0.0,  # the batch learner runs none at inner_epochs=1 (needs_old)
               "train": total(perf.TRAIN_STEP),
               "weight_sync": total(perf.TRAIN_WEIGHT_SYNC),
               "trainer_busy": total(perf.TRAINER_BUSY),
               "engine_busy": total(perf.ENGINE_BUSY)}
        row["other"] = row["step_s"] - sum(row[k] for k in (*PARTS, "reward"))
        rows.append(row)
    return rows


def nonstop_repeat(setup: Setup, steps: int, compiles: CompileCounter,
                   workdir: Path) -> dict[str, Any]:
    first = setup.learner.step
    before = compiles.count
    with perf.run(workdir), gc_heap_frozen():  # as `nonstop rl` runs its learner
        asyncio.run(run_steps(setup.learner, steps))
    after = compiles.count - before
    rows = step_parts(workdir / "events.jsonl", first)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return summary("nonstop", med, [r["step_s"] for r in rows], after)


def summary(system: str, med: dict[str, float], steps_s: list[float],
            compiles: int) -> dict[str, Any]:
    generated = NUM_PROMPTS * GROUP * NEW_TOKENS
    out = {"system": system, **{f"{k}_s": v for k, v in med.items() if k != "step_s"},
           "step_s": med["step_s"], "tokens_per_s": generated / med["step_s"],
           "rollout_tokens_per_s": generated / med["rollout"] if med["rollout"] else None,
           "compiles_after_warmup": compiles, "steps_s": steps_s}
    return out


def tunix_repeat(python: str, steps: int, warmup: int) -> dict[str, Any]:
    script = Path(__file__).with_name("tunix_rl_step.py")
    proc = subprocess.run([python, str(script), "--steps", str(steps), "--warmup", str(warmup)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the Tunix side failed ({python} {script}, exit {proc.returncode});"
                           f" its stderr ends:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_tunix_env(directory: Path) -> str:
    """A virtual environment with google-tunix (and the jax it pins) at `directory`."""
    python = directory / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(directory)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"google-tunix=={TUNIX_VERSION}"],
                   check=True)
    return str(python)


# ---- the profile ---------------------------------------------------------------------------------


def profile(setup: Setup, directory: Path) -> dict[str, Any]:
    """Where one more step's time goes: a jax.profiler trace of it, then the step's parts timed
    in isolation on its own trajectories."""
    learner, trainer = setup.learner, setup.trainer
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with jax.profiler.trace(str(directory / "jax_trace")):
            asyncio.run(run_steps(learner, 1))
        groups, _ = asyncio.run(learner.collect(learner.step))
    out["jax_trace"] = str(directory / "jax_trace")
    out["donation_warnings"] = sum("donated" in str(w.message) for w in caught)
    episodes = [t for g in groups for t in g]

    t = time.perf_counter()
    packed = trainer.pack(episodes)
    out["pack_s"] = time.perf_counter() - t
    stats = [p.stats for p in packed]
    out["packing"] = {"batches": len(packed), "rows_used": sum(s.rows_used for s in stats),
                      "row_slots": len(packed) * trainer.cfg.packing.rows_per_batch,
                      "real_tokens": sum(s.real_tokens for s in stats),
                      "padded_tokens": sum(s.padded_tokens for s in stats),
                      "trained_tokens": sum(t.num_sampled for t in episodes),
                      "bucket": [int(p.batch.tokens.shape[1]) for p in packed]}
    slots = sum(int(np.prod(p.batch.tokens.shape)) for p in packed)
    out["packing"]["fill"] = out["packing"]["real_tokens"] / slots

    batch = trainer._put(packed[0].batch)
    timings = collections.defaultdict(list)
    for _ in range(5):
        t = time.perf_counter()
        ref = trainer._logprobs(trainer._reference_params, trainer.state.frozen, batch)
        timings["reference_pass_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        cur = trainer._logprobs(trainer.state.params, trainer.state.frozen, batch)
        timings["logprob_pass_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(trainer._put(packed[0].batch))
        timings["host_to_device_s"].append(time.perf_counter() - t)
    out.update({k: statistics.median(v) for k, v in timings.items()})

    # At staleness 0 the engine's behaviour log-probs are the current policy's: compare them with
    # the trainer's own pass on the same tokens (what an "old" log-prob pass would recompute).
    mask = np.asarray(packed[0].batch.loss_mask)
    behaviour = np.asarray(packed[0].batch.behavior_logprobs)[mask]
    out["behaviour_vs_current_max_abs"] = float(np.abs(behaviour - np.asarray(cur)[mask]).max())
    out["behaviour_vs_reference_max_abs"] = float(np.abs(behaviour - np.asarray(ref)[mask]).max())
    out["needs_old_pass"] = bool(trainer.needs_old)

    # The optimizer step alone (the same batch, state donated and replaced as in train()).
    full = dataclasses.replace(batch, ref_logprobs=ref)
    step_times = []
    for _ in range(5):
        t = time.perf_counter()
        trainer.state, metrics = trainer._step(trainer.state, full)
        jax.block_until_ready(metrics)
        step_times.append(time.perf_counter() - t)
    out["train_step_jit_s"] = statistics.median(step_times)
    t = time.perf_counter()
    trainer.train(episodes)
    out["trainer_train_s"] = time.perf_counter() - t
    t = time.perf_counter()
    learner.sync_weights()
    out["weight_sync_s"] = time.perf_counter() - t

    return out


# ---- main ----------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:6.2f}" if a and b else "   n/a"


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ("step_s", "rollout_s", "reward_s", "reference_s", "old_logprobs_s", "train_s",
            "weight_sync_s", "other_s")
    print(f"{'system':8} {'step':>7} {'rollout':>7} {'reward':>7} {'ref':>7} {'old':>7} "
          f"{'train':>7} {'sync':>7} {'other':>7} {'tok/s':>7} {'compiles':>8}")
    for r in rows:
        cells = " ".join(f"{r[c]:7.3f}" if r.get(c) is not None else f"{'-':>7}" for c in cols)
        print(f"{r['system']:8} {cells} {r['tokens_per_s']:7.0f} "
              f"{r['compiles_after_warmup']:8d}")
    by = {r["system"]: r for r in rows}
    if "tunix" in by:
        n, t = by["nonstop"], by["tunix"]
        print("nonstop/tunix time: " + "  ".join(
            f"{c.removesuffix('_s')} {ratio(n.get(c), t.get(c)).strip()}"
            for c in ("step_s", "rollout_s", "reference_s", "train_s")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true",
                        help="3 timed steps after 2 warm-up, one repetition")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (10)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (3)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions (3)")
    parser.add_argument("--modes", nargs="+", default=["staleness0"], choices=list(MODES),
                        help="staleness0: the batch learner; 1 and 2 are not implemented yet")
    parser.add_argument("--tunix-python", default=None,
                        help="a Python with google-tunix installed; runs Tunix side by side")
    parser.add_argument("--make-tunix-env", type=Path, default=None, metavar="DIR",
                        help=f"create a venv in DIR with google-tunix=={TUNIX_VERSION} and use it")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="profile one more nonstop step (jax trace and breakdown) into DIR")
    parser.add_argument("--buckets", type=int, nargs="+", default=[144],
                        help="packing buckets (144: two 72-token episodes per row)")
    parser.add_argument("--rows", type=int, default=16, help="packed rows per batch")
    parser.add_argument("--max-segments", type=int, default=2)
    parser.add_argument("--prefill-rows", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=1)
    args = parser.parse_args()
    steps = args.steps or (3 if args.quick else 10)
    warmup = args.warmup or (2 if args.quick else 3)
    repeats = args.repeats or (1 if args.quick else 3)
    for mode in args.modes:
        if MODES[mode] is not None:
            print(f"mode {mode}: {MODES[mode]}")
    if "staleness0" not in args.modes:
        sys.exit("no implemented mode requested (only staleness0 is)")
    tunix_python = args.tunix_python
    if args.make_tunix_env is not None:
        tunix_python = make_tunix_env(args.make_tunix_env)

    compiles = CompileCounter()
    t = time.perf_counter()
    setup = build(args)
    setup.engine.start()
    with tempfile.TemporaryDirectory() as tmp:
        with perf.run(Path(tmp) / "warmup"), gc_heap_frozen():
            asyncio.run(run_steps(setup.learner, warmup))
        print(f"nonstop: built and warmed up ({warmup} steps) in {time.perf_counter() - t:.1f}s;"
              f" {jax.default_backend()}, {steps} timed steps x {repeats} repetitions; packing "
              f"buckets={args.buckets} rows={args.rows}; engine slots={NUM_PROMPTS * GROUP} "
              f"prefill_rows={args.prefill_rows} decode_steps={args.decode_steps}")
        reps: dict[str, list[dict[str, Any]]] = {"nonstop": [], "tunix": []}
        for r in range(repeats):
            order = ["nonstop", "tunix"] if r % 2 == 0 else ["tunix", "nonstop"]
            for system in order:
                if system == "nonstop":
                    reps[system].append(nonstop_repeat(setup, steps, compiles,
                                                       Path(tmp) / f"rep{r}"))
                elif tunix_python:
                    reps[system].append(tunix_repeat(tunix_python, steps, warmup))
                else:
                    continue
                last = reps[system][-1]
                print(f"  repetition {r + 1} {system}: step {last['step_s']:.3f}s")
        rows = []
        for system, results in reps.items():
            if not results:
                continue
            keys = [k for k, v in results[0].items() if isinstance(v, float)]
            row = {k: statistics.median(x[k] for x in results if x.get(k) is not None)
                   for k in keys}
            row.update(system=system, repeats=len(results),
                       compiles_after_warmup=sum(x["compiles_after_warmup"] for x in results),
                       step_s_per_repeat=[x["step_s"] for x in results],
                       mode="staleness0", steps=steps, warmup=warmup)
            if system == "tunix":
                row.update(version=results[0]["version"], jax=results[0]["jax"],
                           weight_sync_calls=results[0]["weight_sync_calls"])
            rows.append(row)
        print_table(rows)
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            with perf.run(args.profile / "perf"):
                report = profile(setup, args.profile)
            print("profile: " + json.dumps(report, indent=1))
            rows[0]["profile"] = report
    setup.engine.stop()
    if args.out is not None:
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps({"benchmark": "rl_step", **row}) + "\n")


if __name__ == "__main__":
    main()
