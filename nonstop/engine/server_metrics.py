"""The Prometheus metrics of `nonstop serve`, rendered in the text exposition format at /metrics
(no client library: counters, gauges and histograms written out by hand)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nonstop.engine.protocol import ServingEngine

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _Histogram:
    def __init__(self, name: str, doc: str, buckets: Sequence[float] = _LATENCY_BUCKETS):
        self.name, self.doc, self.buckets = name, doc, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            total += n
            le = "+Inf" if bound == math.inf else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return lines


class Metrics:
    """The server's Prometheus metrics, rendered in the text exposition format at /metrics."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.running = 0  # generation requests being served
        self.ttft = _Histogram("nonstop_time_to_first_token_seconds",
                               "Seconds from a request's arrival to its first generated token.")
        self.itl = _Histogram("nonstop_inter_token_latency_seconds",
                              "Seconds between consecutive generated tokens of a request.")
        self.e2e = _Histogram("nonstop_e2e_request_latency_seconds",
                              "Seconds from a request's arrival to its last token.")

    def count_request(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def render(self, engine: ServingEngine | None) -> str:
        lines = ["# HELP nonstop_requests_total HTTP requests answered, by endpoint and status.",
                 "# TYPE nonstop_requests_total counter"]
        for (endpoint, status), n in sorted(self.requests.items()):
            lines.append(f'nonstop_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        for name, doc, kind, value in [
            ("nonstop_prompt_tokens_total", "Prompt tokens of generation requests.", "counter",
             self.prompt_tokens),
            ("nonstop_generation_tokens_total", "Tokens generated.", "counter",
             self.generation_tokens),
            ("nonstop_requests_running", "Generation requests being served.", "gauge",
             self.running),
        ]:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {value}"]
        if engine is not None:
            stats = engine.stats()
            slots, max_len = engine.config.max_slots, engine.config.max_len
            for name, doc, value in [
                ("nonstop_queue_depth", "Requests waiting for a slot.", stats.waiting),
                ("nonstop_slots_in_use", "Engine slots running a request.", stats.active_slots),
                ("nonstop_slots_total", "Engine slots.", slots),
                ("nonstop_kv_cache_usage_ratio", "Fraction of KV-cache positions holding tokens.",
                 stats.cached_tokens / (slots * max_len)),
            ]:
                lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name} {value}"]
        for histogram in (self.ttft, self.itl, self.e2e):
            lines += histogram.render()
        return "\n".join(lines) + "\n"


__all__ = ["Metrics"]
