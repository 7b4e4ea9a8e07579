"""XProf capture of chosen steps, with span names as TraceAnnotations (jax on CPU)."""

import glob
import subprocess
import sys

import pytest

from nonstop import perf


def test_import_does_not_pull_in_jax():
    code = "import sys; from nonstop import perf; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_capture_steps_traces_chosen_steps_with_span_names(fresh, tmp_path):
    import jax
    import jax.numpy as jnp

    fresh(annotate_jax=True)
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    x = jnp.ones((7, 5))
    f(x).block_until_ready()
    capture = perf.capture_steps({2, 3}, tmp_path / "xprof")
    for step in range(6):
        with perf.span(perf.TRAIN_STEP, step=step):
            with perf.device_busy(perf.TRAINER, step=step):
                f(x).block_until_ready()
    assert capture.captured == [2, 3] and capture.sessions == 1 and not capture.active
    assert perf.recorder.STATE.capture is None  # the watcher removed itself when done
    (xplane,) = glob.glob(str(tmp_path / "xprof" / "**" / "*.xplane.pb"), recursive=True)
    data = open(xplane, "rb").read()
    assert b"train/step" in data and b"trainer/device_busy" in data
    assert len([e for e in perf.current().events() if e.name == perf.TRAIN_STEP]) == 6


def test_capture_validation(fresh, tmp_path):
    with pytest.raises(ValueError, match="steps is empty"):
        perf.capture_steps([], tmp_path)
