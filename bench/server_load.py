"""Load test of `nonstop serve` over loopback (docs/serving.md): many concurrent streaming
clients, some of which disconnect midway.

Each client streams one /v1/completions request (a token-id prompt, greedy, end-of-sequence
ignored, so every finishing request generates exactly `--max-tokens`); every `--disconnect-every`
th client closes its connection after its second token chunk. Figures: time to first token and
inter-token latency (the gap between two token chunks over the tokens the later one carries)
p50/p99 as the clients see them, the same from the server's /metrics histograms (bucket upper
bounds), generated tokens/s, and whether the server is clean afterwards
(every other request finished with all its tokens; /metrics shows 0 slots in use and 0
requests running).

    python -m bench.server_load --url http://127.0.0.1:8000 [--api-key KEY]
    python -m bench.server_load --tiny      # starts nonstop serve on a tiny random checkpoint
        [--clients 200] [--max-tokens 32] [--prompt-len 16] [--disconnect-every 5]
        [--slots 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


@dataclasses.dataclass
class ClientRecord:
    disconnects: bool
    started: float
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)


@dataclasses.dataclass(frozen=True)
class LoadResult:
    records: list[ClientRecord]
    wall_s: float
    max_tokens: int

    @property
    def finishers(self) -> list[ClientRecord]:
        return [r for r in self.records if not r.disconnects]

    @property
    def complete(self) -> bool:
        """Every client that did not disconnect got all its tokens and a finish reason."""
        return all(r.error is None and r.finish_reason == "length" and r.tokens == self.max_tokens
                   for r in self.finishers)

    def ttft(self) -> list[float]:
        return [r.chunk_times[0] - r.started for r in self.records if r.chunk_times]

    def inter_token(self) -> list[float]:
        gaps = []
        for r in self.records:
            for i in range(1, len(r.chunk_times)):
                gap = (r.chunk_times[i] - r.chunk_times[i - 1]) / max(r.chunk_tokens[i], 1)
                gaps += [gap] * max(r.chunk_tokens[i], 1)
        return gaps

    def summary(self) -> dict[str, float | int | bool]:
        ttft, itl = self.ttft(), self.inter_token()
        return {"clients": len(self.records),
                "disconnecting": len(self.records) - len(self.finishers),
                "complete": self.complete,
                "errors": sum(r.error is not None for r in self.finishers),
                "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
                "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
                "tokens_per_second": sum(r.tokens for r in self.records) / self.wall_s,
                "wall_s": self.wall_s}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def _client(http: httpx.AsyncClient, record: ClientRecord, body: dict) -> None:
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    record.error = event["error"]["message"]
                    return
                for choice in event["choices"]:
                    n = len(choice.get("token_ids") or [])
                    if n:
                        record.chunk_times.append(time.perf_counter())
                        record.chunk_tokens.append(n)
                    record.finish_reason = choice["finish_reason"] or record.finish_reason
                if record.disconnects and len(record.chunk_times) >= 2:
                    return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as error:
        record.error = f"{type(error).__name__}: {error}"


async def run_load(base_url: str, *, clients: int = 200, max_tokens: int = 32,
                   prompt_len: int = 16, disconnect_every: int = 5, vocab: int = 250,
                   api_key: str | None = None, seed: int = 0,
                   timeout_s: float = 600.0) -> LoadResult:
    """Start `clients` streaming requests at once; return what each saw."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    records = [ClientRecord(disconnects=disconnect_every > 0 and i % disconnect_every == 0,
                            started=0.0) for i in range(clients)]
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=timeout_s) as http:
        start = time.perf_counter()
        tasks = []
        for record in records:
            body = {"prompt": [rng.randrange(3, vocab) for _ in range(prompt_len)],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}
            record.started = time.perf_counter()
            tasks.append(asyncio.create_task(_client(http, record, body)))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
        wall = time.perf_counter() - start
    return LoadResult(records=records, wall_s=wall, max_tokens=max_tokens)


def gauge(metrics_text: str, name: str) -> float:
    """A gauge's value in Prometheus text."""
    match = re.search(rf"^{name} (\S+)$", metrics_text, re.MULTILINE)
    if match is None:
        raise KeyError(f"{name} not in /metrics")
    return float(match.group(1))


def histogram_quantile(metrics_text: str, name: str, q: float) -> float:
    """The q-quantile (0-1) of a Prometheus histogram: the upper bound of the bucket it falls
    in, as the server saw it (its buckets bound the precision)."""
    buckets = [(float(le), float(n)) for le, n in re.findall(
        rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', metrics_text, re.MULTILINE)]
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    target = q * buckets[-1][1]
    return next(le for le, n in buckets if n >= target)


def wait_idle(base_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until no slot is in use and no request runs; the gauges seen last."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        seen = {name: gauge(text, name) for name in
                ("nonstop_slots_in_use", "nonstop_requests_running", "nonstop_queue_depth")}
        if not any(seen.values()) or time.monotonic() > deadline:
            return seen
        time.sleep(0.1)


# ---------------------------------------------------------------- a server to load


@contextlib.contextmanager
def tiny_server(slots: int, max_len: int) -> Iterator[str]:
    """`nonstop serve` on the tests' tiny random Llama checkpoint (a source checkout only)."""
    from tests.engine.test_server import build_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp) / "tiny")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        process = subprocess.Popen(
            [sys.executable, "-m", "nonstop.cli.serve", str(model_dir), "--port", str(port),
             "--max-slots", str(slots), "--max-len", str(max_len), "--log-level", "warning"],
            env=dict(os.environ, NONSTOP_API_KEY=""))
        try:
            deadline = time.monotonic() + 300
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                time.sleep(0.25)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running nonstop serve")
    where.add_argument("--tiny", action="store_true", help="start one on a tiny checkpoint")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--disconnect-every", type=int, default=5)
    parser.add_argument("--slots", type=int, default=8, help="--max-slots of the --tiny server")
    args = parser.parse_args(argv)

    with (contextlib.nullcontext(args.url) if args.url
          else tiny_server(args.slots, 2 * (args.prompt_len + args.max_tokens))) as url:
        result = asyncio.run(run_load(url, clients=args.clients, max_tokens=args.max_tokens,
                                      prompt_len=args.prompt_len,
                                      disconnect_every=args.disconnect_every,
                                      api_key=args.api_key))
        idle = wait_idle(url)
        text = httpx.get(f"{url}/metrics", timeout=10).text
    server = {f"server_{short}_{q}_s": histogram_quantile(text, name, int(q[1:]) / 100)
              for short, name in (("ttft", "nonstop_time_to_first_token_seconds"),
                                  ("itl", "nonstop_inter_token_latency_seconds"))
              for q in ("p50", "p99")}
    summary = result.summary() | server | {f"after_{k}": v for k, v in idle.items()}
    for key, value in summary.items():
        shown = f"{value * 1000:.1f} ms" if key.endswith("_s") and key != "wall_s" else value
        print(f"{key:32s} {shown}")
    return 0 if result.complete and not any(idle.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
