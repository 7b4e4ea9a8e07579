"""Single-turn GRPO step benchmark (docs/benchmarks.md): nonstop's learner at max_staleness 0, 1
and 2 against Google's Tunix on the same workload, side by side in one run, and where nonstop's
step time goes.

Workload (the same on both sides): a random Qwen3-style decoder, 4 layers, width 256, 4 heads of
64, 2 KV heads, feed-forward 512, vocabulary 1024, tied embeddings, float32; per step 8 prompts
of 8 random tokens (the same prompts on both sides) x 4 samples, exactly 64 new tokens at
temperature 0.9 (no end-of-sequence token exists); plain SGD at 1e-3 (no momentum, no clipping);
GRPO (`RLAlgorithmConfig.grpo()`: group-normalised advantages, clip 0.2, k3 KL to the initial
policy in the loss with coefficient 0.04, one optimizer pass); reward: the share of token 7 in
the completion.

nonstop's side is what `nonstop rl` runs (nonstop/recipes/rl_recipe.py): single-turn episodes
(`agentic.single_turn.PromptEpisodes`) through the orchestrator and group queue into the
`StreamingLearner`, over an `Engine` and a `PolicyTrainer`. A mode is the learner's
`max_staleness`: `staleness0` collects a step's groups, trains, pushes the weights (the
synchronous step); `staleness1`/`staleness2` let rollouts run one/two versions ahead, so
generation overlaps training. A step's time is the interval between two learner steps' ends
(steady-state throughput); its parts are nonstop's perf spans clipped to that interval: `rollout`
is the trainer's wait for groups (`train/data_wait`: all of generation at staleness 0, only what
training did not hide above it), `reference` the reference log-prob pass, `train` the optimizer
step(s), `weight_sync` the push to the engine. The trainer's log-prob pass is wrapped to wait for
its result, so the reference pass is not counted inside the train step that waits on it. Tunix's
side (bench/tunix_rl_step.py) runs in its own Python (`--tunix-python`, or `--make-tunix-env DIR`
builds one) as a subprocess; repetitions alternate the systems. nonstop's steps run inside
`gc_heap_frozen()`, as `nonstop rl` runs its learner. Medians over the timed steps, then over
repetitions; compiles after warm-up are counted. `--profile DIR` adds a breakdown of one
staleness-0 step (jax.profiler trace, packing fill, isolated pass times, donation warnings, and
the optimizer step's XLA op time by kind: matrix products, layout copies, other).

    python -m bench.rl_step [--tunix-python /tmp/tunix-venv/bin/python] [--quick] [--steps 10]
                            [--warmup 3] [--repeats 3] [--modes staleness0 staleness1 staleness2]
                            [--profile DIR] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import functools
import itertools
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
from nonstop.agentic.config import AgentConfig, OrchestratorConfig, StreamingLearnerConfig
from nonstop.agentic.single_turn import ExampleStream, PromptEpisodes
from nonstop.agentic.streaming import StepRecord, StreamingLearner
from nonstop.engine import Engine, EngineConfig, SamplingParams, gc_heap_frozen
from nonstop.models import Tokenizer, init_decoder
from nonstop.rl import RLAlgorithmConfig
from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
from nonstop.rl.rewards import Example, Reward
from nonstop.rl.trajectory import Trajectory
from nonstop.train import OptimizerConfig, PackingConfig

TUNIX_VERSION = "0.1.7"
MODES = {"staleness0": 0, "staleness1": 1, "staleness2": 2}
STEP_END = "bench/step_end"  # a zero-length span at each learner step's end


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
    """Group g's prompt: the (g % 8)-th of the 8 that bench/tunix_rl_step.py feeds Tunix at its
    step g // 8."""
    for step in itertools.count():
        for i, prompt in enumerate(prompts_of(step)):
            yield Example(prompt=prompt, answer="", id=f"{step}/{i}")


@dataclasses.dataclass
class Setup:
    """One mode's learner, its trainer and engine, and the next group id to draw."""

    staleness: int
    learner: StreamingLearner
    trainer: PolicyTrainer
    engine: Engine
    next_group: int = 0
    last: list[Trajectory] = dataclasses.field(default_factory=list)  # the last step's episodes


def build(args: argparse.Namespace, staleness: int) -> Setup:
    cfg = model_config("large")  # 4 layers, width 256, vocab 1024, tied, float32
    assert cfg.vocab_size == VOCAB
    model = init_decoder(cfg, seed=0)
    packing = PackingConfig(buckets=tuple(args.buckets), rows_per_batch=args.rows,
                            max_segments_per_row=args.max_segments)
    optimizer = OptimizerConfig(name="sgd", learning_rate=1e-3, b1=0.0, schedule="constant",
                                weight_decay=0.0, max_grad_norm=None)
    trainer = PolicyTrainer(model, PolicyTrainerConfig(
        algorithm=RLAlgorithmConfig.grpo(), optimizer=optimizer, packing=packing, seed=0))
    # Episodes in flight: a step's worth per version the rollouts may lead by.
    concurrency = (staleness + 1) * NUM_PROMPTS * GROUP
    engine = Engine(trainer.model(), EngineConfig(
        max_slots=concurrency, max_len=PROMPT_TOKENS + NEW_TOKENS,
        prefill_chunks=(PROMPT_TOKENS,), prefill_rows=args.prefill_rows,
        decode_steps_per_call=args.decode_steps))
    agent = AgentConfig(max_turns=1, max_tokens_per_turn=NEW_TOKENS,
                        max_episode_tokens=NEW_TOKENS, step_timeout_s=None,
                        sampling=SamplingParams(temperature=0.9))
    config = StreamingLearnerConfig(
        groups_per_step=NUM_PROMPTS, max_staleness=staleness,
        orchestrator=OrchestratorConfig(group_size=GROUP, max_concurrency=concurrency, seed=0,
                                        agent=agent))
    episodes = PromptEpisodes(token_tokenizer(), ExampleStream(examples()),
                              Reward("token_share", token_share))
    setup = Setup(staleness, StreamingLearner(trainer, engine, episodes, config), trainer,
                  engine)

    async def on_step(record: StepRecord) -> None:
        with perf.span(STEP_END, step=record.version):
            pass

    setup.learner.on_step = on_step
    train = trainer.train

    def keeping(trajectories: list[Trajectory]) -> dict[str, float]:
        setup.last = list(trajectories)
        return train(trajectories)

    trainer.train = keeping
    wait_for_logprobs(trainer)
    return setup


def wait_for_logprobs(trainer: PolicyTrainer) -> None:
    """Make the trainer's log-prob pass wait for its result, so its device time lands in its own
    span (`train/data_wait`, stage logprobs) instead of in the optimizer step that waits for it."""
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


def run_steps(setup: Setup, n: int) -> None:
    """`n` learner steps on the next groups (one learner run: rollouts of the first step start
    at its beginning, and those in flight at its end are dropped)."""
    ids = itertools.count(setup.next_group)
    asyncio.run(setup.learner.run(n, ids))
    setup.next_group += (n + setup.staleness) * NUM_PROMPTS  # past every group it may have begun


def covered(spans: list[Any], a: int, b: int, name: str, stage: str | None = None, *,
            free: bool = False) -> float:
    """Seconds of [a, b] (ns) covered by `name` spans (with tag stage=`stage`; `free`: none)."""
    cut = sorted((max(e.t0, a), min(e.t1, b)) for e in spans if e.name == name
                 and e.t1 > a and e.t0 < b
                 and (stage is None or e.tags.get("stage") == stage)
                 and (not free or "stage" not in e.tags))
    total, edge = 0, a
    for t0, t1 in cut:
        t0 = max(t0, edge)
        if t1 > t0:
            total, edge = total + t1 - t0, t1
    return total / 1e9


def step_parts(events_path: Path) -> list[dict[str, float]]:
    """Per step after the run's first (between consecutive STEP_END marks): wall time and its
    parts, seconds, each part the union of its spans clipped to the interval."""
    log = perf.read_events(str(events_path))
    spans = [e for e in log.events if e.ph == "X"]
    ends = sorted(e.t1 for e in spans if e.name == STEP_END)
    rows = []
    for a, b in itertools.pairwise(ends):
        total = functools.partial(covered, spans, a, b)
        row = {"step_s": (b - a) / 1e9,
               "rollout": total(perf.TRAIN_DATA_WAIT, free=True),
               "reward": total(perf.ROLLOUT_REWARD),
               "reference": total(perf.TRAIN_DATA_WAIT, "logprobs"),
               "old_logprobs": 0.0,  # none at inner_epochs=1 (PolicyTrainer.needs_old)
               "train": total(perf.TRAIN_STEP),
               "weight_sync": total(perf.TRAIN_WEIGHT_SYNC),
               "engine_busy": total(perf.ENGINE_BUSY)}
        row["other"] = row["step_s"] - sum(row[k] for k in PARTS)
        rows.append(row)
    return rows


def nonstop_repeat(setup: Setup, steps: int, compiles: CompileCounter,
                   workdir: Path) -> dict[str, Any]:
    before = compiles.count
    with perf.run(workdir), gc_heap_frozen():  # as `nonstop rl` runs its learner
        run_steps(setup, steps + 1)  # the first step's end starts the first timed interval
    after = compiles.count - before
    rows = step_parts(workdir / "events.jsonl")
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    rewards = [r.reward_mean for r in setup.learner.records]
    return {**summary(f"nonstop/s{setup.staleness}", med, [r["step_s"] for r in rows], after),
            "reward_last": rewards[-1]}


def summary(system: str, med: dict[str, float], steps_s: list[float],
            compiles: int) -> dict[str, Any]:
    generated = NUM_PROMPTS * GROUP * NEW_TOKENS
    return {"system": system, **{f"{k}_s": v for k, v in med.items() if k != "step_s"},
            "step_s": med["step_s"], "tokens_per_s": generated / med["step_s"],
            "compiles_after_warmup": compiles, "steps_s": steps_s}


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


STEP_REPEATS = 5  # optimizer steps timed (and traced) alone


def op_kind(name: str) -> str:
    """The kind of an XLA CPU op named in a trace: a matrix product (YNNPACK/XNNPACK/oneDNN
    fusion or a plain dot), a layout copy (a transpose or copy fusion), or anything else
    (elementwise, reductions, scatters)."""
    if name.startswith(("ynn_fusion", "xnn_fusion", "onednn", "dot")):
        return "dots"
    if name.startswith("copy") or "transpose" in name:
        return "layout_copies"
    return "other"


def op_ms_by_kind(trace_dir: Path, calls: int) -> dict[str, float]:
    """Milliseconds per call of the XLA ops in a `jax.profiler` trace, by `op_kind`, and their
    total (runtime and Python events left out). Empty where the trace has no JSON export."""
    import gzip

    files = sorted(trace_dir.glob("plugins/profile/*/*.trace.json.gz"))
    if not files:
        return {}
    with gzip.open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    totals: collections.Counter[str] = collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") != "X" or name.startswith(("$", "Thunk", "Slinky", "PjitFunction")):
            continue
        totals[op_kind(name)] += event.get("dur", 0)
    out = {kind: round(us / calls / 1000, 2) for kind, us in sorted(totals.items())}
    out["total"] = round(sum(totals.values()) / calls / 1000, 2)
    return out


def profile(setup: Setup, directory: Path) -> dict[str, Any]:
    """Where one more staleness-0 step's time goes: a jax.profiler trace of it, then the step's
    parts timed in isolation on its own trajectories."""
    trainer = setup.trainer
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with jax.profiler.trace(str(directory / "jax_trace")):
            run_steps(setup, 1)
    out["jax_trace"] = str(directory / "jax_trace")
    out["donation_warnings"] = sum("donated" in str(w.message) for w in caught)
    episodes = setup.last

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

    # The engine's behaviour log-probs against the trainer's own pass on the same tokens (the
    # trainer has taken one step since they were sampled: the gap includes that update).
    mask = np.asarray(packed[0].batch.loss_mask)
    behaviour = np.asarray(packed[0].batch.behavior_logprobs)[mask]
    out["behaviour_vs_current_max_abs"] = float(np.abs(behaviour - np.asarray(cur)[mask]).max())
    out["behaviour_vs_reference_max_abs"] = float(np.abs(behaviour - np.asarray(ref)[mask]).max())
    out["needs_old_pass"] = bool(trainer.needs_old)

    # The optimizer step alone (the same batch, state donated and replaced as in train()),
    # traced: its XLA ops' time by kind.
    full = dataclasses.replace(batch, ref_logprobs=ref)
    step_times = []
    with jax.profiler.trace(str(directory / "train_step_trace")):
        for _ in range(STEP_REPEATS):
            t = time.perf_counter()
            trainer.state, metrics = trainer._step(trainer.state, full)
            jax.block_until_ready(metrics)
            step_times.append(time.perf_counter() - t)
    out["train_step_jit_s"] = statistics.median(step_times)
    out["train_step_op_ms"] = op_ms_by_kind(directory / "train_step_trace", STEP_REPEATS)
    t = time.perf_counter()
    trainer.train(episodes)
    out["trainer_train_s"] = time.perf_counter() - t
    t = time.perf_counter()
    setup.engine.update_weights(trainer.policy_params(), setup.engine.policy_version + 1)
    out["weight_sync_s"] = time.perf_counter() - t
    return out


# ---- main ----------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:6.2f}" if a and b else "   n/a"


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ("step_s", "rollout_s", "reward_s", "reference_s", "old_logprobs_s", "train_s",
            "weight_sync_s", "other_s")
    print(f"{'system':12} {'step':>7} {'wait':>7} {'reward':>7} {'ref':>7} {'old':>7} "
          f"{'train':>7} {'sync':>7} {'other':>7} {'tok/s':>7} {'compiles':>8}")
    for r in rows:
        cells = " ".join(f"{r[c]:7.3f}" if r.get(c) is not None else f"{'-':>7}" for c in cols)
        print(f"{r['system']:12} {cells} {r['tokens_per_s']:7.0f} "
              f"{r['compiles_after_warmup']:8d}")
    by = {r["system"]: r for r in rows}
    if "tunix" in by:
        t = by["tunix"]
        for name, n in by.items():
            if name != "tunix":
                print(f"{name}/tunix time: " + "  ".join(
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
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                        help="the learner's max_staleness (default: all three)")
    parser.add_argument("--tunix-python", default=None,
                        help="a Python with google-tunix installed; runs Tunix side by side")
    parser.add_argument("--make-tunix-env", type=Path, default=None, metavar="DIR",
                        help=f"create a venv in DIR with google-tunix=={TUNIX_VERSION} and use it")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="profile one more staleness-0 step (jax trace and breakdown) into DIR")
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
    tunix_python = args.tunix_python
    if args.make_tunix_env is not None:
        tunix_python = make_tunix_env(args.make_tunix_env)

    compiles = CompileCounter()
    setups: dict[str, Setup] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            t = time.perf_counter()
            setup = setups[mode] = build(args, MODES[mode])
            setup.engine.start()
            with perf.run(Path(tmp) / f"warmup-{mode}"), gc_heap_frozen():
                run_steps(setup, warmup)
            print(f"nonstop {mode}: built and warmed up ({warmup} steps) in "
                  f"{time.perf_counter() - t:.1f}s; engine slots {setup.engine.config.max_slots}")
        print(f"{jax.default_backend()}, {steps} timed steps x {repeats} repetitions; packing "
              f"buckets={args.buckets} rows={args.rows}; prefill_rows={args.prefill_rows} "
              f"decode_steps={args.decode_steps}")
        reps: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for r in range(repeats):
            systems = [*args.modes, "tunix"] if tunix_python else list(args.modes)
            for system in systems if r % 2 == 0 else systems[::-1]:
                if system == "tunix":
                    result = tunix_repeat(tunix_python, steps, warmup)
                else:
                    result = nonstop_repeat(setups[system], steps, compiles,
                                            Path(tmp) / f"rep{r}-{system}")
                reps[result["system"]].append(result)
                print(f"  repetition {r + 1} {result['system']}: step {result['step_s']:.3f}s")
        rows = []
        for system, results in reps.items():
            keys = [k for k, v in results[0].items() if isinstance(v, float)]
            row = {k: statistics.median(x[k] for x in results if x.get(k) is not None)
                   for k in keys}
            row.update(system=system, repeats=len(results),
                       compiles_after_warmup=sum(x["compiles_after_warmup"] for x in results),
                       step_s_per_repeat=[x["step_s"] for x in results], steps=steps,
                       warmup=warmup)
            if system == "tunix":
                row.update(version=results[0]["version"], jax=results[0]["jax"],
                           weight_sync_calls=results[0]["weight_sync_calls"])
            rows.append(row)
        print_table(rows)
        if args.profile is not None and "staleness0" in setups:
            args.profile.mkdir(parents=True, exist_ok=True)
            with perf.run(args.profile / "perf"):
                report = profile(setups["staleness0"], args.profile)
            print("profile: " + json.dumps(report, indent=1))
            rows[0]["profile"] = report
    for setup in setups.values():
        setup.engine.stop()
    if args.out is not None:
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps({"benchmark": "rl_step", **row}) + "\n")


if __name__ == "__main__":
    main()
