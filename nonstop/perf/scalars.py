"""Scalar sinks for derived figures: TensorBoard (tensorboardX), JSONL, and Prometheus.

While a run is active the flusher summarizes each `scalars_every_s` window (`analysis.summarize`)
and writes the flat figures (`busy/engine`, `idle/trainer/train/data_wait`,
`rate/engine/tokens_per_s`, `gauge/engine/queue_depth/time_mean`, …) to
`run_dir/perf_metrics.jsonl` (one object per window: `step`, `wall_time`, then the figures) and,
when enabled, as TensorBoard scalars under `run_dir/tensorboard/` with the window index as step.

Live figures are per window: a span that ends after a window closes counts toward the window it
ends in, clipped there, so a span longer than the window is under-counted live. The complete
figures come from the whole events.jsonl afterwards.

`PrometheusExporter` (optional, `PerfConfig.prometheus_port`) serves running totals — counters,
the last gauge values, span counts and seconds per stage, dropped events — at `/metrics`. It
needs `prometheus_client`, imported only when a port is configured.
"""

import json
import math
import os
from typing import Any

from nonstop.perf.analysis import Figures


class ScalarWriter:
    """Appends derived figures to a JSONL file and, optionally, TensorBoard."""

    def __init__(self, metrics_path: str, tensorboard_dir: str | None) -> None:
        self.metrics_path = metrics_path
        self._file = open(metrics_path, "a", encoding="utf-8")
        self._tensorboard_dir = tensorboard_dir
        self._tb: Any = None  # made at the first write, on the flusher thread: importing
        # tensorboardX imports torch when it is installed, which takes seconds.

    def write(self, figures: Figures, step: int, wall_time: float) -> dict[str, float]:
        scalars = {k: v for k, v in figures.scalars().items() if math.isfinite(v)}
        self._file.write(json.dumps({"step": step, "wall_time": wall_time, **scalars}) + "\n")
        self._file.flush()
        if self._tensorboard_dir is not None:
            if self._tb is None:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(logdir=self._tensorboard_dir, flush_secs=30)
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, global_step=step, walltime=wall_time)
        return scalars

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str) -> list[dict[str, float]]:
    """The rows of a `perf_metrics.jsonl`; a half-written last line is skipped."""
    if os.path.isdir(path):
        path = os.path.join(path, "perf_metrics.jsonl")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


class PrometheusExporter:
    """Serves a run's running totals at `http://<host>:<port>/metrics`."""

    def __init__(self, totals: Any, recorder: Any, config: Any) -> None:
        try:
            import prometheus_client
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        except ImportError as err:  # optional dependency
            raise RuntimeError(
                f"PerfConfig.prometheus_port={config.prometheus_port} needs prometheus_client; "
                "pip install 'nonstop[prometheus]' or leave prometheus_port=None"
            ) from err

        class _Collector:
            def collect(self) -> Any:
                counters = CounterMetricFamily(
                    "nonstop_perf_counter", "perf.count totals", labels=["name"]
                )
                for name, value in dict(totals.counters).items():
                    counters.add_metric([name], value)
                gauges = GaugeMetricFamily("nonstop_perf_gauge", "last perf.gauge", labels=["name"])
                for name, value in dict(totals.gauges).items():
                    gauges.add_metric([name], value)
                seconds = CounterMetricFamily(
                    "nonstop_perf_span_seconds", "seconds inside spans", labels=["name"]
                )
                for name, value in dict(totals.span_seconds).items():
                    seconds.add_metric([name], value)
                count = CounterMetricFamily("nonstop_perf_spans", "spans closed", labels=["name"])
                for name, value in dict(totals.span_count).items():
                    count.add_metric([name], value)
                dropped = CounterMetricFamily("nonstop_perf_dropped_events", "ring overflow")
                dropped.add_metric([], recorder.dropped)
                yield from (counters, gauges, seconds, count, dropped)

        self.registry = prometheus_client.CollectorRegistry()
        self.registry.register(_Collector())
        self._server, self._thread = prometheus_client.start_http_server(
            config.prometheus_port, registry=self.registry
        )
        self.port = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
