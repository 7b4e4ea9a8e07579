"""Training-step benchmark (docs/benchmarks.md): SFT tokens/s with packing vs padding.

bench.engine's model (random Llama-style decoder: 8 layers, width 512, 8 heads of 64, 4 KV heads,
feed-forward 1408, vocab 8192) takes SFT steps on one pool of random token sequences with lengths
uniform in [32, 1024], every token a target. Both modes see the same sequences through the same
jitted, donated step (`make_train_step` with the SFT loss):
  - `pad`:  one sequence per row, rows padded to the smallest bucket holding the batch's longest;
  - `pack`: first-fit packing of several sequences per row (segment-masked attention).
A repetition is one pass over the pool; figures are medians over repetitions, after a warm-up
pass that compiles every bucket shape (compiles after warm-up are counted and printed).

Figures per mode: real (non-padding) tokens/s, fill ratio, model FLOPs/s (6·N·tokens, N the
parameters outside the embedding lookup, attention FLOPs not counted), peak memory (device
`peak_bytes_in_use` where the backend reports it, else the process's peak RSS), and the ratio
pack / pad. Goal: >= 1.5.

    python -m bench.train_step [--out results.jsonl] [--repeats 3] [--quick]

`--quick`: 2 layers, width 128, vocab 2048, lengths 32-512, 4 rows (about a minute on an idle
CPU core; several on a loaded one).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import jax
import numpy as np

from nonstop.models import ModelConfig, init_decoder
from nonstop.sft.preference import sft_loss_fn
from nonstop.train import (
    OptimizerConfig,
    PackingConfig,
    TokenSequence,
    TrainState,
    build_optimizer,
    make_train_step,
    pack_units,
)


def bench_model(quick: bool) -> ModelConfig:
    if quick:
        return ModelConfig(family="llama", vocab_size=2048, hidden_size=128,
                           intermediate_size=352, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=32)
    return ModelConfig(family="llama", vocab_size=8192, hidden_size=512, intermediate_size=1408,
                       num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64)


def sequence_pool(count: int, low: int, high: int, vocab: int, seed: int = 0
                  ) -> list[TokenSequence]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(low, high + 1, size=count)
    return [TokenSequence(tokens=rng.integers(3, vocab, size=n, dtype=np.int32),
                          loss_mask=np.ones(n, bool), origin=f"pool:{i}")
            for i, n in enumerate(lengths)]


def peak_memory_bytes() -> tuple[int, str]:
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device peak_bytes_in_use"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"


def run_mode(mode: str, cfg: ModelConfig, pool: list[TokenSequence], packing: PackingConfig,
             repeats: int, dtype: jax.typing.DTypeLike) -> dict:
    batches = [p for p in pack_units(((s,) for s in pool),
                                     PackingConfig(buckets=packing.buckets, mode=mode,
                                                   rows_per_batch=packing.rows_per_batch,
                                                   max_segments_per_row=64))]
    optimizer_cfg = OptimizerConfig(learning_rate=1e-4, schedule="constant", total_steps=10**6)
    optimizer = build_optimizer(optimizer_cfg)
    state = TrainState.create(init_decoder(cfg, seed=0, dtype=dtype), optimizer,
                              rng=jax.random.key(0))
    step = make_train_step(sft_loss_fn(), optimizer)
    device_batches = [jax.device_put(p.batch) for p in batches]

    def one_pass(state: TrainState) -> tuple[TrainState, float]:
        start = time.perf_counter()
        for batch in device_batches:
            state, metrics = step(state, batch)
        metrics["loss"].block_until_ready()
        return state, time.perf_counter() - start

    state, _ = one_pass(state)  # warm-up: compiles each bucket shape once
    compiled = step._cache_size()
    times = []
    for _ in range(repeats):
        state, seconds = one_pass(state)
        times.append(seconds)
    recompiles = step._cache_size() - compiled
    real = sum(p.stats.real_tokens for p in batches)
    padded = sum(p.stats.padded_tokens for p in batches)
    seconds = statistics.median(times)
    params = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_embeddings
                                                                     else 1)
    peak, peak_kind = peak_memory_bytes()
    return {
        "mode": mode,
        "batches": len(batches),
        "shapes": sorted({tuple(p.batch.shape) for p in batches}),
        "real_tokens": real,
        "fill_ratio": real / (real + padded),
        "seconds_median": seconds,
        "seconds_all": times,
        "tokens_per_s": real / seconds,
        "model_flops_per_s": 6 * params * real / seconds,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "compiles_after_warmup": recompiles,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write one JSON object per mode here")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small model, short sequences")
    parser.add_argument("--sequences", type=int, default=None, help="sequences in the pool")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)

    cfg = bench_model(args.quick)
    high = 512 if args.quick else 1024
    buckets = (128, 256, 512) if args.quick else (256, 512, 1024)
    rows = 4 if args.quick else 8
    count = args.sequences or (48 if args.quick else 128)
    pool = sequence_pool(count, 32, high, cfg.vocab_size)
    packing = PackingConfig(buckets=buckets, rows_per_batch=rows)
    dtype = jax.numpy.bfloat16 if args.dtype == "bfloat16" else jax.numpy.float32
    results = [run_mode(mode, cfg, pool, packing, args.repeats, dtype) for mode in ("pad", "pack")]
    ratio = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
    for result in results:
        result.update(ratio_pack_over_pad=ratio, quick=args.quick, model=cfg.num_params(),
                      sequences=count, length_range=[32, high], buckets=list(buckets),
                      rows_per_batch=rows, dtype=args.dtype, device=str(jax.devices()[0]))

    print(f"model: {cfg.num_layers} layers, width {cfg.hidden_size}, vocab {cfg.vocab_size} "
          f"({cfg.num_params() / 1e6:.1f}M params); {count} sequences of 32-{high} tokens; "
          f"{rows} rows per batch, buckets {buckets}; {args.repeats} repeats; {jax.devices()[0]}")
    print(f"{'mode':<6}{'batches':>8}{'fill':>7}{'tokens/s':>12}{'model TFLOP/s':>15}"
          f"{'peak MiB':>10}{'recompiles':>12}")
    for r in results:
        print(f"{r['mode']:<6}{r['batches']:>8}{r['fill_ratio']:>7.2f}{r['tokens_per_s']:>12.0f}"
              f"{r['model_flops_per_s'] / 1e12:>15.4f}{r['peak_memory_bytes'] / 2**20:>10.0f}"
              f"{r['compiles_after_warmup']:>12}")
    print(f"pack / pad tokens/s: {ratio:.2f}x (goal >= 1.5)  [peak memory: "
          f"{results[0]['peak_memory_kind']}]")
    if args.out:
        with open(args.out, "a", encoding="utf-8") as handle:
            for r in results:
                handle.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
