"""Tool-latency hiding benchmark (docs/benchmarks.md): the RolloutOrchestrator against a batch-
synchronous rollout and against the engine's own limit.

Model: random Qwen3-style decoder, 2 layers, width 128, 4 heads of 32, 2 KV heads, ffw 256, vocab
256, tied embeddings, float32 (`--size large`: 4 layers, width 256, vocab 1024).
Episode: 8 random prompt tokens; 3 model turns of exactly 16 tokens (end-of-sequence ignored);
after turns 1 and 2 a scripted tool call sleeps for its latency (asyncio) and returns 4 tokens;
reward: the mean answer token / vocab.
Tool latency: fixed 0, 50, 200, 1000 ms, and log-normal with mean 200 ms and sigma 1.
Modes, same episodes and engine:
  - limit: the orchestrator with tool latency 0 (what the engine does when nothing waits);
  - sync: batch-synchronous turns over batches of `--sync-batch` episodes (default: the slots):
    all generate a turn, then all their tools run in parallel, then the next turn;
  - async: the RolloutOrchestrator, `max_concurrency` episodes in flight, sized by Little's law
    from the measured limit throughput and the latency (reported per row).
Figures: episodes/s, generated tokens/s, engine busy fraction (engine device-busy spans / wall
time), median and p99 episode latency, event-loop lag p99 (a 5 ms sleeper), compiles after
warm-up, and the ratios async/limit and async/sync. Medians over --repeats.
Episodes/s and busy are given twice: over the whole run, and over its steady state
(`steady_window`: after one turnover of the episodes that all start together, until the last one
starts). A training run's orchestrator never drains between steps, so the steady figures are
what it sees; the whole-run figures also charge each run's ramp-up and drain, which at 1000 ms
(~1,450 in flight, ~4 s per episode) are a sizeable share of a 20 s run.

    python -m bench.agentic [--out results.jsonl] [--quick] [--repeats 3] [--slots 64]
                            [--latencies 200ms 1000ms] [--seconds 20]

KV layouts and the prefix cache (one run, side by side; each combination its own engine):
`--kv-layout dense paged` and `--prefix-cache on off` run every combination (paged only for
`off`); `--system-prompt-tokens 1000` puts the same 1,000 tokens before every episode's prompt
(a system prompt and tool schemas), `--kv-cache-tokens` sizes the paged pool (default: the dense
cache, slots x max_len) and `--max-len` the positions per sequence. Each row then also reports
the prompt tokens the engine was given and computed, the share served from the prefix cache
(`prefix_hit_rate`: first turns' tokens found there) and from sessions' kept blocks or rows
(`cached_rate`: all prompt tokens not computed), evictions, preemptions and the most episodes in
flight at once.

    python -m bench.agentic --kv-layout paged --prefix-cache on off \
        --system-prompt-tokens 1000 --latencies 200ms --seconds 8 --repeats 1
    python -m bench.agentic --kv-layout dense paged --max-len 512 --kv-cache-tokens 32768 \
        --parked-slots 0 --latencies 1000ms lognormal3s --seconds 10 --repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from bench.remote_servers import serving
from nonstop import perf
from nonstop.agentic.agent import derive_seed
from nonstop.agentic.config import AgentConfig, OrchestratorConfig
from nonstop.agentic.orchestrator import EpisodeSpec, LoopLagMonitor, RolloutOrchestrator
from nonstop.agentic.trajectory_builder import ScriptedToolInteraction
from nonstop.engine import (
    Engine,
    EngineConfig,
    RemoteEngine,
    RolloutClient,
    SamplingParams,
    gc_heap_frozen,
)
from nonstop.models import ModelConfig, init_decoder

PROMPT, TURNS, TURN_TOKENS, TOOL_TOKENS = 8, 3, 16, 4
LATENCIES: dict[str, tuple[str, float]] = {
    "0ms": ("fixed", 0.0), "50ms": ("fixed", 0.05), "200ms": ("fixed", 0.2),
    "1000ms": ("fixed", 1.0), "lognormal200ms": ("lognormal", 0.2),
    "lognormal3s": ("lognormal", 3.0)}


def model_config(size: str) -> ModelConfig:
    if size == "small":
        return ModelConfig.tiny("qwen3", vocab_size=256, hidden_size=128, intermediate_size=256,
                                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                                tie_embeddings=True)
    return ModelConfig.tiny("qwen3", vocab_size=1024, hidden_size=256, intermediate_size=512,
                            num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                            tie_embeddings=True)


def latency_of(kind: str, mean_s: float, episode: int, turn: int) -> float:
    """The tool latency of (episode, turn): fixed, or log-normal (sigma 1) with that mean."""
    if kind == "fixed":
        return mean_s
    rng = np.random.default_rng(derive_seed(99, episode, turn))
    return float(rng.lognormal(math.log(mean_s) - 0.5, 1.0)) if mean_s > 0 else 0.0


def no_wait(episode: int, turn: int) -> float:
    return 0.0


def system_prompt(tokens: int, vocab: int) -> tuple[int, ...]:
    """The `tokens` ids every episode's prompt starts with (none for 0)."""
    return tuple(np.random.default_rng(derive_seed(3, tokens)).integers(0, vocab, tokens).tolist())


def prompt_of(episode: int, vocab: int, system: tuple[int, ...] = ()) -> list[int]:
    own = np.random.default_rng(derive_seed(7, episode)).integers(0, vocab, PROMPT).tolist()
    return [*system, *own]


def prompt_tokens_of(episodes: int, system: int) -> int:
    """Prompt tokens the engine is given over `episodes` episodes: turn t's prompt is the whole
    context so far."""
    first = system + PROMPT
    return episodes * sum(first + t * (TURN_TOKENS + TOOL_TOKENS) for t in range(TURNS))


def make_factory(vocab: int, latency: Callable[[int, int], float],
                 system: tuple[int, ...] = ()):
    def make(spec: EpisodeSpec) -> ScriptedToolInteraction:
        async def tool(turn: int, sampled) -> list[int]:
            await asyncio.sleep(latency(spec.episode_id, turn))
            return [(t * 7 + turn) % vocab for t in sampled[:TOOL_TOKENS]]

        return ScriptedToolInteraction(prompt_of(spec.episode_id, vocab, system),
                                       num_turns=TURNS,
                                       tool=tool, reward_fn=lambda a: float(np.mean(a)) / vocab)

    return make


AGENT = AgentConfig(max_turns=TURNS, max_tokens_per_turn=TURN_TOKENS, ignore_eos=True)


async def run_async(engine: RolloutClient, episodes: int, concurrency: int, vocab: int,
                    latency: Callable[[int, int], float], system: tuple[int, ...] = ()
                    ) -> list[tuple[float, float]]:
    """(start, end) perf_counter times of `episodes` episodes through the orchestrator (group
    size 1)."""
    config = OrchestratorConfig(group_size=1, max_concurrency=concurrency, agent=AGENT)
    orchestrator = RolloutOrchestrator(engine, make_factory(vocab, latency, system), config)
    groups = await orchestrator.run_groups(range(episodes))
    return [(t.info["started_at"], t.info["finished_at"]) for g in groups.values() for t in g]


async def _sync_turn(engine: RolloutClient, context: list[int], session, episode: int, turn: int,
                     vocab: int, latency: Callable[[int, int], float] | None) -> None:
    """One episode's turn in the synchronous baseline: generate; then its tool (if any)."""
    if latency is None:
        params = SamplingParams(temperature=1.0, max_tokens=TURN_TOKENS,
                                seed=derive_seed(0, episode, turn))
        context += (await engine.generate(context, params, session=session)).tokens
    else:
        await asyncio.sleep(latency(episode, turn + 1))
        context += [(t * 7 + turn) % vocab for t in context[-TOOL_TOKENS:]]


async def run_sync(engine: RolloutClient, episodes: int, batch: int, vocab: int,
                   latency: Callable[[int, int], float], system: tuple[int, ...] = ()
                   ) -> list[tuple[float, float]]:
    """Batch-synchronous turns: a batch generates a turn, then all its tools run, and so on.
    Returns each episode's (start, end): its batch's."""
    times = []
    for start in range(0, episodes, batch):
        t0 = time.perf_counter()
        ids = range(start, min(start + batch, episodes))
        contexts = {e: prompt_of(e, vocab, system) for e in ids}
        sessions = {e: engine.session() for e in ids}
        for turn in range(TURNS):
            await asyncio.gather(*(_sync_turn(engine, contexts[e], sessions[e], e, turn, vocab,
                                              None) for e in ids))
            if turn < TURNS - 1:
                await asyncio.gather(*(_sync_turn(engine, contexts[e], sessions[e], e, turn,
                                                  vocab, latency) for e in ids))
        for s in sessions.values():
            s.close()
        times += [(t0, time.perf_counter())] * len(ids)
    return times


def steady_window(times: list[tuple[float, float]], concurrency: int) -> tuple[float, float]:
    """The run's steady state: from when `concurrency` episodes have finished (one turnover of
    the episodes started together at the beginning) to when the last episode started (after
    which fewer and fewer are in flight). A long training run lives in this regime; the ramp
    and the drain of a finite benchmark run happen once per run, not once per batch."""
    ends = sorted(end for _, end in times)
    return ends[min(concurrency, len(ends)) - 1], max(start for start, _ in times)


def peak_in_flight(times: list[tuple[float, float]]) -> int:
    """The most episodes between their start and their end at once."""
    events = sorted([(start, 1) for start, _ in times] + [(end, -1) for _, end in times])
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def counter(engine: RolloutClient, stats: object, name: str) -> int | None:
    """A counter of `engine.stats()`, or None where this backend does not count it (the
    remote and vLLM clients see no compiles, evictions or pipelined tokens; the remote one no
    prefill or prefix-cache figures: its RemoteStats' 0 there means "not reported")."""
    if isinstance(engine, RemoteEngine) and name in ("prefix_hit_tokens", "cached_tokens"):
        return None
    value = getattr(stats, name, None)
    return sum(value.values()) if isinstance(value, dict) else value


def measure(engine: RolloutClient, run: Callable[[], object], episodes: int,
            concurrency: int, system_tokens: int = 0) -> dict[str, float]:
    """Run one configuration under a fresh perf recorder and compute its figures, over the whole
    run and over its steady state (`steady_window`)."""
    recorder = perf.configure(perf.PerfConfig(capacity=4_000_000))
    before = engine.stats()

    async def main():
        async with LoopLagMonitor(interval_s=0.005) as lag:
            with perf.span("bench/run") as window:
                t0 = time.perf_counter()
                times = await run()
                wall = time.perf_counter() - t0
        return times, wall, lag.quantile(0.99), window.id

    with gc_heap_frozen():  # as `nonstop agentic` trains
        times, wall, lag_p99, window_id = asyncio.run(main())
    events = perf.current().events()
    window = next(e for e in events if e.id == window_id)
    busy = perf.busy_fraction(events, perf.ENGINE, (window.t0, window.t1))
    a, b = steady_window(times, concurrency)
    steady = {"steady_s": 0.0, "steady_episodes_per_s": float("nan"),
              "steady_engine_busy": float("nan")}
    if b - a > 0.1 * wall:  # too short a steady state (e.g. one sync batch) is not reported
        ns = (int(a * 1e9) - recorder.anchor_perf_ns, int(b * 1e9) - recorder.anchor_perf_ns)
        steady = {"steady_s": b - a,
                  "steady_episodes_per_s": sum(a < end <= b for _, end in times) / (b - a),
                  "steady_engine_busy": perf.busy_fraction(events, perf.ENGINE, ns)}
    durations = [end - start for start, end in times]
    after = engine.stats()

    def delta(name: str) -> int | None:
        a, b = counter(engine, before, name), counter(engine, after, name)
        return None if a is None or b is None else b - a

    tokens = delta("generated_tokens")
    # Tokens the engine computed past a request's end (pipelining; decode_steps_per_call > 1),
    # as a fraction of those it kept: device time inside "busy" that bought nothing.
    dropped = delta("dropped_tokens")
    given = prompt_tokens_of(episodes, system_tokens)
    prefilled, hits = delta("prefilled_tokens"), delta("prefix_hit_tokens")
    return {"episodes_per_s": episodes / wall, "tokens_per_s": tokens / wall,
            "dropped_frac": None if dropped is None else dropped / max(tokens, 1),
            "peak_in_flight": peak_in_flight(times),
            "prompt_tokens": given, "prefilled_tokens": prefilled, "prefix_hit_tokens": hits,
            "prefix_hit_rate": None if hits is None else hits / given,
            "cached_rate": None if prefilled is None else 1 - prefilled / given,
            "evictions": delta("evictions"), "preemptions": delta("preemptions"),
            "engine_busy": busy, **steady, "latency_p50_s": float(np.median(durations)),
            "latency_p99_s": float(np.quantile(durations, 0.99)), "loop_lag_p99_ms": lag_p99,
            "wall_s": wall, "compiles_after_warmup": delta("traces")}


def median_of(runs: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Each figure's median over the runs (None where a backend does not report it)."""
    return {k: None if any(r[k] is None for r in runs) else statistics.median(r[k] for r in runs)
            for k in runs[0]}


def fmt(value: float | None, spec: str) -> str:
    """`value` formatted by `spec`, or "-" right-aligned to its width where it is None."""
    if value is None:
        return "-".rjust(int(spec.split(".")[0] or 0))
    return format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--slots", type=int, default=None)
    parser.add_argument("--sync-batch", type=int, default=None)
    parser.add_argument("--size", choices=("small", "large"), default="small")
    parser.add_argument("--max-concurrency", type=int, default=2048)
    parser.add_argument("--prefill-rows", type=int, default=8,
                        help="EngineConfig.prefill_rows (turns starting together share a call)")
    parser.add_argument("--decode-steps", type=int, default=1,
                        help="EngineConfig.decode_steps_per_call (decode steps per device call)")
    parser.add_argument("--pipeline-depth", type=int, default=3,
                        help="EngineConfig.pipeline_depth (decode calls in flight; 3: the device "
                             "runs two calls ahead of the host's bookkeeping)")
    parser.add_argument("--swap-gib", type=float, default=0.0,
                        help="EngineConfig.swap_space_gib (evicted sessions' caches kept on the "
                             "host; 0: off, their next turn prefills its whole context)")
    parser.add_argument("--parked-slots", type=int, default=None,
                        help="EngineConfig.parked_slots (evicted sessions' caches kept in a "
                             "second cache on the device; default --max-concurrency: every "
                             "episode in flight; 0: off; dense layout only)")
    parser.add_argument("--kv-layout", nargs="+", choices=("dense", "paged"), default=["dense"],
                        help="EngineConfig.kv_layout; several: one engine each, side by side")
    parser.add_argument("--prefix-cache", nargs="+", choices=("on", "off"), default=["on"],
                        help="EngineConfig.prefix_cache of the paged layout; both: side by side")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="EngineConfig.kv_cache_tokens of the paged layout (default: the "
                             "dense cache's slots x max_len)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=None,
                        help="EngineConfig.max_len (default: the longest episode, rounded up)")
    parser.add_argument("--system-prompt-tokens", type=int, default=0,
                        help="tokens of one system prompt every episode's prompt starts with")
    parser.add_argument("--latencies", nargs="+", choices=tuple(LATENCIES),
                        default=tuple(LATENCIES))
    parser.add_argument("--seconds", type=float, default=None,
                        help="target wall time per async configuration (20; 6 with --quick)")
    parser.add_argument("--backend", nargs="+", choices=("local", "vllm", "remote"),
                        default=["local"],
                        help="rollout backends, one engine each, side by side: local (Engine), "
                             "vllm (VLLMEngine), remote (RemoteEngine over --servers nonstop "
                             "serve processes this benchmark starts)")
    parser.add_argument("--servers", type=int, default=1,
                        help="nonstop serve processes behind the remote backend (each with "
                             "--slots slots)")
    args = parser.parse_args()
    combos = []
    for backend in dict.fromkeys(args.backend):
        if backend != "local":
            combos.append((backend, "dense", True))
            continue
        combos += [(backend, layout, cache == "on") for layout in args.kv_layout
                   for cache in (args.prefix_cache if layout == "paged" else ["on"])]
    rows: list[dict[str, object]] = []
    for backend, layout, prefix_cache in combos:
        rows += bench_engine(args, backend, layout, prefix_cache)
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    if len(engines) > 1:
        print("\nside by side (async rows; ratios within each engine):")
        for name in args.latencies:
            for r in rows:
                if r["latency"] == name and r["mode"] == "async":
                    ratio = next(q for q in rows if q["latency"] == name
                                 and q["mode"] == "ratios" and q["engine"] == r["engine"])
                    print(f"{name:>15} {r['engine']:>28}: {r['episodes_per_s']:7.1f} eps/s  "
                          f"busy {r['engine_busy']:.2f} (steady {r['steady_engine_busy']:.2f})  "
                          f"in flight {r['peak_in_flight']:5d}  async/limit "
                          f"{ratio['async_over_limit']:.2f} (steady "
                          f"{ratio['steady_async_over_limit']:.2f})  async/sync "
                          f"{ratio['async_over_sync']:.2f} (steady "
                          f"{ratio['steady_async_over_sync']:.2f})  cached "
                          f"{fmt(r['cached_rate'], '.3f')} prefix "
                          f"{fmt(r['prefix_hit_rate'], '.3f')}  evictions {r['evictions']}  "
                          f"preemptions {r['preemptions']}")
    if args.out:
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


@contextlib.contextmanager
def open_backend(backend: str, model, config: EngineConfig, servers: int
                 ) -> Iterator[RolloutClient]:
    """`backend`'s engine on `model`, stopped (and its servers) on exit: `config` whole for the
    local engine and each `nonstop serve`, its slots and max_len for vLLM."""
    if backend == "local":
        with Engine(model, config) as engine:
            yield engine
    elif backend == "remote":
        with (serving(model, servers=servers, engine=config) as urls,
              RemoteEngine(urls, max_len=config.max_len, policy=model) as engine):
            yield engine
    else:
        from nonstop.engine import VLLMEngine, VLLMEngineConfig

        with VLLMEngine(model, VLLMEngineConfig(max_slots=config.max_slots,
                                                max_len=config.max_len)) as engine:
            yield engine


def bench_engine(args: argparse.Namespace, backend: str, layout: str, prefix_cache: bool
                 ) -> list[dict[str, object]]:
    """Every latency's limit, sync and async rows (and their ratios) on one engine."""
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        print("\nvllm: skipped: vLLM is not importable in this Python (pip install "
              "'nonstop[vllm]' in a venv of its own; docs/engine.md, VLLMEngine)")
        return []
    repeats = args.repeats or (1 if args.quick else 3)
    # 64 slots: enough rows a call that the host's per-call work (one GIL for the scheduler
    # and the event loop, on the CPU cores the device runs on) keeps up with the device; with
    # 128 the device is busier still, but a batch-synchronous turn then hides more of its
    # tools behind its own long generation (200 ms: 2.3x sync against 3.2x at 64).
    slots = args.slots or (16 if args.quick else 64)
    sync_batch = args.sync_batch or slots * (args.servers if backend == "remote" else 1)
    cfg = model_config(args.size)
    S = args.system_prompt_tokens
    longest = S + PROMPT + TURNS * TURN_TOKENS + (TURNS - 1) * TOOL_TOKENS + 8
    max_len = args.max_len or (longest if S == 0 else -(-longest // 64) * 64)
    paged = layout == "paged"
    parked = 0 if paged else (args.max_concurrency if args.parked_slots is None
                              else args.parked_slots)
    swap = 0.0 if paged else args.swap_gib
    label = f"{backend} {layout}" + ((" prefix-cache " + ("on" if prefix_cache else "off"))
                                     if paged else "")
    if backend == "remote":
        label = f"remote x{args.servers}"
    elif backend == "vllm":
        label = "vllm"
    system = system_prompt(S, cfg.vocab_size)
    # Attention buckets and batched prefill on: throughput over bit-exact batch invariance
    # (see EngineConfig).
    config = EngineConfig(
        max_slots=slots, max_len=max_len, prefill_chunks=(16, 64) if S == 0 else (16, 64, 256),
        decode_buckets=4, prefill_rows=args.prefill_rows, decode_steps_per_call=args.decode_steps,
        pipeline_depth=args.pipeline_depth, swap_space_gib=swap, parked_slots=parked,
        kv_layout=layout, block_size=args.block_size, prefix_cache=prefix_cache,
        kv_cache_tokens=args.kv_cache_tokens if paged else None)
    # Each nonstop serve runs `config` whole (`--engine` flags); vLLM only its size.
    shown = config if backend != "vllm" else EngineConfig(max_slots=slots, max_len=max_len)
    settings = {"backend": backend, "engine": label,
                "servers": args.servers if backend == "remote" else None}
    with open_backend(backend, init_decoder(cfg, seed=0), config, args.servers) as engine:
        return bench_latencies(args, engine, shown, settings, sync_batch, repeats, system)


def bench_latencies(args: argparse.Namespace, engine: RolloutClient, config: EngineConfig,
                    settings: dict[str, object], sync_batch: int, repeats: int,
                    system: tuple[int, ...]) -> list[dict[str, object]]:
    """`bench_engine`'s rows on a running engine; `config`: the engine's settings, as run."""
    vocab = model_config(args.size).vocab_size
    S, max_len = len(system), config.max_len
    # Episodes the engine runs at once: every server's slots.
    slots = config.max_slots * (settings["servers"] or 1)
    paged = config.kv_layout == "paged"
    seconds = args.seconds or (6.0 if args.quick else 20.0)

    # Warm-up (compiles and the host paths), then the limit: what the engine does unhindered.
    asyncio.run(RolloutOrchestrator(engine, make_factory(vocab, no_wait, system),
                                    OrchestratorConfig(group_size=1, max_concurrency=2 * slots,
                                                       agent=AGENT)
                                    ).run_groups(range(10**6, 10**6 + 2 * slots)))
    limit_concurrency = 2 * slots
    probe = measure(engine, functools.partial(run_async, engine, 4 * slots, limit_concurrency,
                                              vocab, no_wait, system), 4 * slots,
                    limit_concurrency, S)
    limit_rate = probe["episodes_per_s"]
    gen_s = TURNS * TURN_TOKENS / max(probe["tokens_per_s"] / limit_concurrency, 1e-9)
    kv_tokens = config.num_blocks * config.block_size if paged else slots * max_len
    settings = {**settings, "kv_layout": config.kv_layout, "prefix_cache": config.prefix_cache,
                "kv_cache_tokens": kv_tokens, "max_len": max_len, "system_prompt_tokens": S,
                "decode_buckets": config.decode_buckets, "prefill_rows": config.prefill_rows,
                "decode_steps_per_call": config.decode_steps_per_call,
                "pipeline_depth": config.pipeline_depth,
                "swap_space_gib": config.swap_space_gib, "parked_slots": config.parked_slots}
    print(f"\n{settings['engine']}: model {args.size}: slots={config.max_slots}"
          + (f" x {args.servers} servers" if settings["servers"] else "")
          + f" max_len={max_len} kv_tokens={kv_tokens} system_prompt={S} "
          f"decode_buckets={config.decode_buckets} prefill_rows={config.prefill_rows} "
          f"decode_steps_per_call={config.decode_steps_per_call} "
          f"pipeline_depth={config.pipeline_depth} swap_space_gib={config.swap_space_gib} "
          f"parked_slots={config.parked_slots} sync_batch={sync_batch} "
          f"repeats={repeats}; limit ~{limit_rate:.1f} episodes/s")
    rows = []
    header = (f"{'latency':>15} {'mode':>6} {'conc':>5} {'eps/s':>8} {'tok/s':>8} {'busy':>5} "
              f"{'steady eps/s':>12} {'busy':>5} {'drop':>5} {'p50 s':>6} {'p99 s':>6} "
              f"{'lag99 ms':>8} {'compiles':>8} {'cached':>6} {'prefix':>6} {'flight':>6}")
    print(header)
    for name in args.latencies:
        kind, mean_s = LATENCIES[name]
        latency = functools.partial(latency_of, kind, mean_s)
        # Little's law: episodes in flight = throughput x time per episode (+60% headroom).
        concurrency = min(args.max_concurrency, max(limit_concurrency, math.ceil(
            1.6 * limit_rate * (gen_s + (TURNS - 1) * mean_s))))
        episodes = max(2 * concurrency, int(limit_rate * seconds))
        results = {}
        for mode in ("limit", "sync", "async"):
            n_sync = max(sync_batch, min(episodes, int(seconds / max(mean_s * 2, 0.05))
                                         * sync_batch))
            if mode == "limit":
                run = functools.partial(run_async, engine, episodes, concurrency, vocab, no_wait,
                                        system)
            elif mode == "sync":
                run = functools.partial(run_sync, engine, n_sync, sync_batch, vocab, latency,
                                        system)
            else:
                run = functools.partial(run_async, engine, episodes, concurrency, vocab, latency,
                                        system)
            n = n_sync if mode == "sync" else episodes
            conc = sync_batch if mode == "sync" else concurrency
            results[mode] = median_of([measure(engine, run, n, conc, S)
                                       for _ in range(repeats)])
            r = results[mode]
            print(f"{name:>15} {mode:>6} {conc:>5} {r['episodes_per_s']:8.1f} "
                  f"{r['tokens_per_s']:8.0f} {r['engine_busy']:5.2f} "
                  f"{r['steady_episodes_per_s']:12.1f} {r['steady_engine_busy']:5.2f} "
                  f"{fmt(r['dropped_frac'], '5.2f')} {r['latency_p50_s']:6.2f} "
                  f"{r['latency_p99_s']:6.2f} {r['loop_lag_p99_ms']:8.1f} "
                  f"{fmt(r['compiles_after_warmup'], '8.0f')} {fmt(r['cached_rate'], '6.3f')} "
                  f"{fmt(r['prefix_hit_rate'], '6.3f')} {r['peak_in_flight']:6.0f}")
            rows.append({"benchmark": "agentic", "size": args.size, "latency": name,
                         "mode": mode, "slots": slots, "concurrency": conc,
                         "episodes": n, "repeats": repeats, **settings, **r})
        a = results["async"]["episodes_per_s"]
        ratio_limit, ratio_sync = a / results["limit"]["episodes_per_s"], a / \
            results["sync"]["episodes_per_s"]
        steady = {m: results[m]["steady_episodes_per_s"] for m in results}
        steady_limit, steady_sync = (steady["async"] / steady["limit"],
                                     steady["async"] / steady["sync"])
        print(f"{name:>15} ratios: async/limit {ratio_limit:.2f}  async/sync {ratio_sync:.2f}  "
              f"steady: async/limit {steady_limit:.2f}  async/sync {steady_sync:.2f}")
        rows.append({"benchmark": "agentic", "size": args.size, "latency": name,
                     "mode": "ratios", "async_over_limit": ratio_limit,
                     "async_over_sync": ratio_sync, "steady_async_over_limit": steady_limit,
                     "steady_async_over_sync": steady_sync, "concurrency": concurrency,
                     "slots": slots, **settings})
    return rows


if __name__ == "__main__":
    main()
