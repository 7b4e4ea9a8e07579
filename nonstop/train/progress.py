"""A terminal progress bar for training runs: steps done, steps per second, ETA and a few metrics.

A thin layer over tqdm that knows about resumed runs (the bar starts at the restored step, and the
rate and ETA count only steps taken in this process) and formats floats compactly. It is fed
Python numbers by `MetricsWriter`; it never touches device arrays.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TextIO

from tqdm.auto import tqdm


class ProgressBar:
    """Progress over `total_steps`, starting at `initial_step` (the resumed step, or 0)."""

    def __init__(
        self,
        total_steps: int,
        *,
        initial_step: int = 0,
        description: str = "train",
        shown_metrics: tuple[str, ...] = ("loss", "learning_rate", "grad_norm"),
        file: TextIO | None = None,
        disable: bool = False,
    ):
        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps!r} is invalid; expected an int >= 1")
        if not 0 <= initial_step <= total_steps:
            raise ValueError(
                f"initial_step={initial_step!r} is invalid; expected an int in [0, {total_steps}]"
            )
        self.shown_metrics = shown_metrics
        self._bar = tqdm(
            total=total_steps,
            initial=initial_step,
            desc=description,
            unit="step",
            dynamic_ncols=True,
            file=file if file is not None else sys.stderr,
            disable=disable,
        )

    @property
    def step(self) -> int:
        return int(self._bar.n)

    def advance_to(self, step: int) -> None:
        """Move the bar to `step` (steps are dispatched; their metrics may come later)."""
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def show(self, metrics: Mapping[str, float]) -> None:
        """Show the chosen metrics of the latest materialised step next to the bar."""
        postfix = {name: _compact(metrics[name]) for name in self.shown_metrics if name in metrics}
        self._bar.set_postfix(postfix, refresh=False)

    def eta_seconds(self) -> float | None:
        """Seconds left at the current rate, or None before the rate is known."""
        rate = self._bar.format_dict.get("rate")
        if not rate:
            return None
        return (self._bar.total - self._bar.n) / rate

    def close(self) -> None:
        self._bar.close()


def _compact(value: float) -> str:
    return f"{value:.4g}"
