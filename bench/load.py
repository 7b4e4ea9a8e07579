"""Checkpoint load benchmark (docs/benchmarks.md): seconds and peak resident memory / size.

Writes a synthetic Llama-style checkpoint of about 1 GB (bf16, several shards, Hugging Face
layout), then loads it in fresh subprocesses two ways, side by side:
  - `nonstop`: `load_pretrained`, one thread mapping the next tensor's file pages (or reading
    it, when it is already in our layout) while the caller places each tensor in our layout
    (transposed on the host into a fresh buffer, each core writing its own range of the
    result's rows, since the bench runs on CPU devices) and the shape-only model is built
    during the first read;
  - `naive`: `safetensors.numpy.load_file` per shard, then `jax.device_put` of each tensor.
Peak RSS is read from getrusage in the loading process; `delta` subtracts the RSS the process
had after importing jax and before loading, so the ratio is about the loader, not the runtime.

    python -m bench.load [--out results.jsonl] [--repeats 3] [--size-gb 1.0] [--phases]

`--phases` also times, in one more fresh subprocess, the parts of the `nonstop` load: mapping
every tensor's file pages (against reading each into one reused buffer, the copy that mapping
saves), building the shape-only model, making a fresh buffer for each (pages faulted in one by
one as written by one thread, or all at once with `MAP_POPULATE`), the host transposes into our
layout (`placement.transposed`, all cores, into buffers already faulted in; also on one thread,
and without the 8-byte word pass), the transposes as the loader runs them (into fresh buffers,
each core faulting in the pages it writes) and, for scale, plain copies of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from nonstop.models import ModelConfig
from nonstop.models.hf_weights import weight_specs


def synthetic_config(size_gb: float) -> ModelConfig:
    layers = max(1, round(8 * size_gb))
    return ModelConfig(family="llama", vocab_size=32_000, hidden_size=2048,
                       intermediate_size=5632, num_layers=layers, num_heads=16, num_kv_heads=16,
                       head_dim=128)


def write_checkpoint(directory: Path, cfg: ModelConfig, shard_bytes: int = 300 * 1024**2) -> int:
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    names: list[str] = []
    total = 0
    weight_map = {}

    def flush() -> None:
        name = f"model-{len(names) + 1:05d}.safetensors"
        save_file(shards[-1], str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shards[-1], name))
        names.append(name)
        shards[-1] = {}

    for spec in weight_specs(cfg):
        arr = (rng.standard_normal(spec.hf_shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        if size and size + arr.nbytes > shard_bytes:
            flush()
            size = 0
        shards[-1][spec.hf_name] = arr
        size += arr.nbytes
        total += arr.nbytes
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    hf = cfg.to_hf()
    hf["dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(hf))
    return total


_LOADER = r"""
import json, resource, sys, time
import jax, jax.numpy as jnp, numpy as np
import psutil
mode, path = sys.argv[1], sys.argv[2]
from flax import nnx
from safetensors.numpy import load_file
from nonstop.models import load_pretrained
jnp.zeros(1).block_until_ready()
base = psutil.Process().memory_info().rss
t0 = time.perf_counter()
if mode == "nonstop":
    model = load_pretrained(path, dtype=jnp.bfloat16)
    leaves = jax.tree.leaves(nnx.state(model))
else:
    import glob
    leaves = []
    for f in sorted(glob.glob(path + "/*.safetensors")):
        for arr in load_file(f).values():
            leaves.append(jax.device_put(arr))
jax.block_until_ready(leaves)
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "peak_rss": peak, "base_rss": base,
                  "loaded_bytes": int(sum(x.nbytes for x in leaves))}))
"""


_PHASES = r"""
import json, sys, time
import jax.numpy as jnp
import numpy as np
from nonstop.models import ModelConfig
from nonstop.models import placement
from nonstop.models.decoder import abstract_decoder
from nonstop.models.hf_weights import weight_specs
from nonstop.models.safetensors_io import SafetensorsReader, aligned_buffer
path = sys.argv[1]
jnp.zeros(1).block_until_ready()
out = {}
with SafetensorsReader(path) as reader:
    specs = weight_specs(ModelConfig.from_hf(path + "/config.json"))
    largest = max(e.end - e.start for e in reader.entries.values())
    reused = aligned_buffer(largest)
    kept = [reader.read(spec.hf_name) for spec in specs]  # the sources of the passes below
    t0 = time.perf_counter()
    for spec in specs:
        reader.read(spec.hf_name, into=reused)
    out["read_reused_buffer"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for spec in specs:
        reader.mapped(spec.hf_name)
    out["map_file_pages"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    abstract_decoder(ModelConfig.from_hf(path + "/config.json"), dtype=jnp.bfloat16,
                     param_dtype=jnp.bfloat16)
    out["shape_only_model"] = time.perf_counter() - t0
    sizes = [a.nbytes for a in kept]
    t0 = time.perf_counter()
    for n in sizes:
        aligned_buffer(n, populate=False)[::4096] = 1
    out["fresh_page_by_page"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fresh = [aligned_buffer(n) for n in sizes]
    out["fresh_populated"] = time.perf_counter() - t0
    work = []
    for spec, array, into in zip(specs, kept, fresh):
        stored, perm = placement.as_stored(spec.to_ours(array))
        if perm != tuple(range(stored.ndim)):
            work.append((stored, perm, into))
    out["transposed_bytes"] = sum(stored.nbytes for stored, _, _ in work)
    for name, kernel in (("transposes", None), ("transposes_one_thread", "one"),
                         ("transposes_plain_blocks", "plain")):
        workers = placement._workers
        if kernel == "one":
            placement._workers = lambda: 1
        if kernel == "plain":  # the same row blocks, all threads, without the 8-byte-word pass
            placement._WORD = np.dtype(np.uint8)
        t0 = time.perf_counter()
        for stored, perm, into in work:
            placement.transposed(stored, perm, into)
        out[name] = time.perf_counter() - t0
        placement._workers = workers
    t0 = time.perf_counter()
    for stored, perm, _ in work:  # the loader's way: each core faults in its own pages
        placement.transposed(stored, perm)
    out["transposes_into_fresh"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for stored, _, into in work:
        into[...] = stored.reshape(-1).view(np.uint8)
    out["plain_copies"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def run_script(script: str, *args: str) -> dict:
    """`script` in a fresh Python process (CPU JAX): the JSON object its last line prints."""
    out = subprocess.run([sys.executable, "-c", script, *args], check=True, capture_output=True,
                         text=True, env={"JAX_PLATFORMS": "cpu", **os.environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--phases", action="store_true",
                        help="also time the nonstop load's parts (reads, transposes, copies)")
    args = parser.parse_args()
    cfg = synthetic_config(args.size_gb)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        t0 = time.perf_counter()
        size = write_checkpoint(directory, cfg)
        shards = len(list(directory.glob("*.safetensors")))
        print(f"checkpoint: {size / 1e9:.2f} GB in {shards} shards, written in "
              f"{time.perf_counter() - t0:.1f}s")
        modes = ("nonstop", "naive")
        all_runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits both
            for mode in modes:
                all_runs[mode].append(run_script(_LOADER, mode, str(directory)))
        phases = run_script(_PHASES, str(directory)) if args.phases else None
        results = {}
        for mode, runs in all_runs.items():
            results[mode] = {
                "mode": mode, "checkpoint_bytes": size, "shards": shards,
                "seconds": statistics.median(r["seconds"] for r in runs),
                "peak_over_size": statistics.median(r["peak_rss"] / size for r in runs),
                "peak_delta_over_size": statistics.median(
                    (r["peak_rss"] - r["base_rss"]) / size for r in runs),
                "repeats": len(runs),
            }
    print(f"{'mode':8} {'seconds':>8} {'peak RSS/size':>14} {'(peak-base)/size':>17}")
    for r in results.values():
        print(f"{r['mode']:8} {r['seconds']:8.2f} {r['peak_over_size']:14.3f} "
              f"{r['peak_delta_over_size']:17.3f}")
    ratio = results["naive"]["peak_delta_over_size"] / results["nonstop"]["peak_delta_over_size"]
    print(f"naive/nonstop peak-memory ratio: {ratio:.2f}  (goal: nonstop (peak-base)/size <= 1.3)")
    speed = results["nonstop"]["seconds"] / results["naive"]["seconds"]
    print(f"nonstop/naive time ratio: {speed:.2f}  (goal: <= 1.0)")
    if phases is not None:
        gb = phases["transposed_bytes"] / 1e9
        print("nonstop load, by part (seconds): " + ", ".join(
            f"{k} {v:.2f}" for k, v in phases.items() if k != "transposed_bytes")
            + f"  ({gb:.2f} GB transposed, {gb / phases['transposes']:.2f} GB/s)")
    if args.out:
        with args.out.open("a") as f:
            for r in results.values():
                f.write(json.dumps({**r, "seconds_over_naive": r["seconds"] / results["naive"]["seconds"]})
                        + "\n")


if __name__ == "__main__":
    main()
