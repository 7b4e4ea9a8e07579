"""Each perf test gets a fresh in-memory recorder and leaves no run or capture behind."""

import pytest

from nonstop import perf
from nonstop.perf import recorder


@pytest.fixture
def fresh():
    """A fresh in-memory recorder; call `fresh(capacity=…)` to reconfigure."""
    previous = recorder.STATE.base_config

    def make(**kwargs):
        return perf.configure(perf.PerfConfig(**kwargs))

    make()
    yield make
    if recorder.STATE.run is not None:
        perf.finish_run()
    if recorder.STATE.capture is not None:
        recorder.STATE.capture.close()
    perf.configure(previous)
