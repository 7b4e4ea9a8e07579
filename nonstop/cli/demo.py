"""`nonstop demo`: the built-in end-to-end job on a default that runs on a laptop CPU.

For now it writes a tiny random Qwen3-style checkpoint in Hugging Face layout, loads it back with
`load_pretrained`, and generates from it with the continuous-batching engine: eight concurrent
requests, sampled with different seeds, reporting tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import numpy as np


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("demo", help="the built-in end-to-end demo",
                                   description=__doc__)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/demo"),
                        help="where the demo writes its checkpoint (default runs/demo)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from nonstop.engine import Engine, SamplingParams
    from nonstop.models import ModelConfig, init_decoder, load_pretrained, save_pretrained

    checkpoint = args.run_dir / "model"
    cfg = ModelConfig.tiny("qwen3", num_layers=2)
    save_pretrained(init_decoder(cfg, seed=0), checkpoint)
    print(f"wrote a tiny {cfg.family} checkpoint ({cfg.num_params():,} parameters) to {checkpoint}")
    model = load_pretrained(checkpoint)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, size=int(rng.integers(4, 12))).tolist()
               for _ in range(args.requests)]

    async def generate_all(engine: Engine):
        return await asyncio.gather(*[
            engine.generate(p, SamplingParams(temperature=1.0, max_tokens=args.max_tokens,
                                              seed=i))
            for i, p in enumerate(prompts)])

    with Engine(model, max_slots=4, max_len=64) as engine:
        start = time.perf_counter()
        completions = asyncio.run(generate_all(engine))
        seconds = time.perf_counter() - start
    generated = sum(len(c.tokens) for c in completions)
    for prompt, c in list(zip(prompts, completions, strict=True))[:3]:
        print(f"prompt {prompt} -> {c.tokens[:12]}... ({c.finish_reason})")
    print(f"{len(completions)} requests, {generated} tokens in {seconds:.2f}s "
          f"({generated / seconds:.0f} tokens/s) with 4 slots")
    return 0
