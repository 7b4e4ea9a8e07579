"""Micro-benchmark: what one empty span, counter or gauge costs on this machine.

    python -m nonstop.perf.overhead            # prints one line per configuration

Configurations: disabled; in-memory ring (no run directory); streaming to a run directory (the
flusher thread drains and encodes concurrently, so its GIL time is included); each of the last
two with `annotate_jax`. Each figure is the median over `repeats` batches of `n` operations, in
nanoseconds per operation. `bench/perf_overhead.py` measures the end-to-end ratio on real
engine and trainer loops; this isolates the per-call cost.
"""

import dataclasses
import statistics
import tempfile
import time

from nonstop.perf import recorder, spans


@dataclasses.dataclass(frozen=True)
class Overhead:
    config: str
    span_ns: float  # one empty `with perf.span(...)`
    count_ns: float  # one perf.count
    gauge_ns: float  # one perf.gauge


def _per_op_ns(fn: object, n: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn(n)  # type: ignore[operator]
        times.append((time.perf_counter_ns() - t0) / n)
    return statistics.median(times)


def _spans(n: int) -> None:
    span = spans.span
    for i in range(n):
        with span("rollout/decode", step=i):
            pass


def _counts(n: int) -> None:
    count = spans.count
    for _ in range(n):
        count("engine/tokens", 8)


def _gauges(n: int) -> None:
    gauge = spans.gauge
    for i in range(n):
        gauge("engine/queue_depth", i)


def _loop(n: int) -> None:
    for _ in range(n):
        pass


def _measure(name: str, n: int, repeats: int) -> Overhead:
    base = _per_op_ns(_loop, n, repeats)
    return Overhead(
        config=name,
        span_ns=_per_op_ns(_spans, n, repeats) - base,
        count_ns=_per_op_ns(_counts, n, repeats) - base,
        gauge_ns=_per_op_ns(_gauges, n, repeats) - base,
    )


def measure(n: int = 20000, repeats: int = 7, with_jax: bool = True) -> list[Overhead]:
    """Per-operation cost in each configuration; restores the previous recorder config after."""
    if recorder.STATE.run is not None:
        raise RuntimeError("perf.overhead.measure: finish the active run first")
    previous = recorder.STATE.base_config
    # The ring must hold a whole batch so no configuration pays for dropping.
    cap = max(previous.capacity, 4 * n)
    out = []
    try:
        configs = [("disabled", False, False), ("memory", True, False)]
        if with_jax:
            configs.append(("memory+jax", True, True))
        for name, enabled, jax_on in configs:
            recorder.configure(
                recorder.PerfConfig(enabled=enabled, capacity=cap, annotate_jax=jax_on)
            )
            out.append(_measure(name, n, repeats))
        for name, jax_on in [("run_dir", False)] + ([("run_dir+jax", True)] if with_jax else []):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = recorder.PerfConfig(
                    capacity=cap, annotate_jax=jax_on, write_trace=False, tensorboard=False
                )
                with recorder.run(tmp, cfg):
                    out.append(_measure(name, n, repeats))
    finally:
        recorder.configure(previous)
    return out


def main() -> None:
    for o in measure():
        print(
            f"{o.config:12s} span {o.span_ns / 1e3:6.2f} µs   count {o.count_ns / 1e3:6.2f} µs"
            f"   gauge {o.gauge_ns / 1e3:6.2f} µs"
        )


if __name__ == "__main__":
    main()
