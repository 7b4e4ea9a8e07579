"""Weight-sync seconds: how long a trainer's `update_weights(state, version)` takes to reach each
rollout backend (the in-process `Engine`, `VLLMEngine`, `RemoteEngine` over `nonstop serve`), on
the 32M engine-benchmark model and on a Qwen3-0.6B-shaped model with random weights.

    python bench/weight_sync.py --model bench32m --backends local,remote,vllm
    python bench/weight_sync.py --model qwen3_0_6b --dtype bfloat16 --backends local,remote,vllm

For each backend and repeat: `call_s`, the seconds `update_weights` takes to return, and
`in_effect_s`, the seconds until a one-token greedy request submitted right after it has
returned (the in-process engine applies weights between device steps, so its call returns at
once), minus that request's time on unchanged weights. For vLLM also `convert_s`: the NNX →
Hugging Face conversion alone (merge, transpose, cast to bytes), part of `call_s`. For remote
(`--servers` `nonstop serve` processes on this host, started here on the same weights, `--dtype`
their compute dtype) two rows, one per transfer: `remote shm` (the blob through POSIX shared
memory) and `remote http` (as the request body); `call_s` is the encode plus the post to every
server, `convert_s` the encode alone (`weight_transfer.encode_weights`: Hugging Face names and
layouts, one safetensors blob in `--dtype`). Each backend's first update is left out (warm-up).
vLLM needs the `vllm` extra; run this from that venv, with the `if __name__ == "__main__":`
guard vLLM's spawned workers need.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/weight_sync.py`

from bench.remote_servers import serving  # noqa: E402
from nonstop.engine import Engine, EngineConfig, RemoteEngine, SamplingParams  # noqa: E402
from nonstop.engine.weight_transfer import encode_weights  # noqa: E402
from nonstop.models import ModelConfig, init_decoder  # noqa: E402

BENCH_32M = ModelConfig(
    family="llama",
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
)
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


def perturbed(params: nnx.State, scale: float, seed: int) -> nnx.State:
    """The same tree with every array moved a little (a new version of the weights)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [
        x + (scale * jax.random.normal(k, x.shape)).astype(x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(tree, moved)


def one_token(engine) -> None:
    if isinstance(engine, RemoteEngine):  # no generate_sync: an event loop per call
        asyncio.run(engine.generate([1, 2, 3, 4], ONE_TOKEN))
    else:
        engine.generate_sync([1, 2, 3, 4], ONE_TOKEN)


def one_token_s(engine) -> float:
    t0 = time.perf_counter()
    one_token(engine)
    return time.perf_counter() - t0


def measure(engine, params: nnx.State, repeats: int, first_version: int = 1
            ) -> list[dict[str, float]]:
    """`repeats` updates after a warm-up one, versions from `first_version` on (a server keeps
    its newest version: an older one would be refused, not applied)."""
    rows = []
    for version in range(first_version, first_version + repeats + 1):
        new = perturbed(params, 1e-3, version)
        jax.block_until_ready(new)
        base = one_token_s(engine)
        t0 = time.perf_counter()
        engine.update_weights(new, version)
        call = time.perf_counter() - t0
        one_token(engine)
        in_effect = time.perf_counter() - t0 - base
        row = {"version": version, "call_s": call, "in_effect_s": in_effect}
        if isinstance(engine, RemoteEngine):  # the encode alone
            t1 = time.perf_counter()
            encode_weights(engine._graphdef, new, engine._rest, engine._weight_dtype)
            row["convert_s"] = time.perf_counter() - t1
        elif hasattr(engine, "_graphdef"):  # VLLMEngine: the conversion alone
            from nonstop.engine.vllm_engine import hf_weights

            t1 = time.perf_counter()
            for _name, array in hf_weights(engine._graphdef, new, engine._rest, engine._dtype):
                array.tobytes()
            row["convert_s"] = time.perf_counter() - t1
        rows.append(row)
    return rows[1:]


def summarize(name: str, rows: list[dict[str, float]]) -> dict[str, float]:
    """Print `rows` and their medians; return the medians."""
    summary = {k: float(np.median([r[k] for r in rows])) for k in rows[0] if k != "version"}
    print(name, json.dumps(rows), flush=True)
    print(f"{name}: median " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()), flush=True)
    return summary


def bench_remote(model, params: nnx.State, args: argparse.Namespace) -> dict[str, dict]:
    """The `remote shm` and `remote http` rows, against the same `--servers` servers."""
    results = {}
    with serving(model, servers=args.servers, engine=EngineConfig(max_slots=2, max_len=64),
                 dtype=args.dtype) as urls:
        for i, transfer in enumerate(("shm", "http")):
            with RemoteEngine(urls, max_len=64, policy=model, weight_dtype=args.dtype,
                              weight_transfer=transfer) as engine:
                rows = measure(engine, params, args.repeats,
                               first_version=1 + i * (args.repeats + 1))
            results[f"remote {transfer}"] = summarize(f"remote {transfer}", rows)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("bench32m", "qwen3_0_6b"), default="bench32m")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--backends", default="local,vllm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--servers", type=int, default=1,
                        help="nonstop serve processes behind the remote backend")
    args = parser.parse_args()
    cfg = BENCH_32M if args.model == "bench32m" else ModelConfig.qwen3_0_6b()
    dtype = jnp.dtype(args.dtype)
    model = init_decoder(cfg, seed=0, dtype=dtype, param_dtype=dtype)
    params = nnx.state(model, nnx.Param)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"model {args.model}: {n_params / 1e6:.1f}M parameters, {args.dtype}", flush=True)
    results = {}
    for backend in args.backends.split(","):
        if backend == "remote":
            results.update(bench_remote(model, params, args))
            continue
        if backend == "local":
            engine = Engine(model, EngineConfig(max_slots=2, max_len=64))
        elif backend == "vllm":
            from nonstop.engine import VLLMEngine, VLLMEngineConfig

            engine = VLLMEngine(
                model, VLLMEngineConfig(max_slots=2, max_len=64, kv_cache_gib=args.kv_cache_gib)
            )
        else:
            raise SystemExit(f"--backends: {backend!r}; valid: local, remote, vllm")
        with engine:
            rows = measure(engine, params, args.repeats)
        results[backend] = summarize(backend, rows)
    print(
        json.dumps(
            {"model": args.model, "dtype": args.dtype, "params_m": n_params / 1e6,
             "servers": args.servers if "remote" in args.backends.split(",") else None,
             **results}
        )
    )


if __name__ == "__main__":
    main()
