"""MetricsWriter (JSONL, TensorBoard, optional W&B, one step behind) and the progress bar."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import struct

import jax.numpy as jnp
import pytest
from tensorboardX.proto import event_pb2

from nonstop.train.metrics import (
    JSONL_NAME,
    TENSORBOARD_DIR,
    MetricsConfig,
    MetricsWriter,
    read_jsonl,
)
from nonstop.train.progress import ProgressBar

QUIET = MetricsConfig(tensorboard=False, progress_bar=False)


class ConversionBomb:
    """A metric value that fails the moment anyone converts it to a host number."""

    def __array__(self, *args, **kwargs):
        raise RuntimeError("converted")


def read_events(run_dir) -> list[event_pb2.Event]:
    """Decode every TFRecord in the TensorBoard event files (length, crc, data, crc)."""
    events = []
    tb_dir = os.path.join(run_dir, TENSORBOARD_DIR)
    for name in sorted(os.listdir(tb_dir)):
        with open(os.path.join(tb_dir, name), "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            payload = data[offset + 12 : offset + 12 + length]
            events.append(event_pb2.Event.FromString(payload))
            offset += 12 + length + 4
    return events


def test_writes_one_step_behind_and_derives_throughput(tmp_path):
    with MetricsWriter(tmp_path, QUIET) as writer:
        assert writer.write(1, {"loss": ConversionBomb()}) is None  # not converted yet
        with pytest.raises(RuntimeError, match="converted"):
            writer.write(2, {"loss": jnp.float32(2.5), "tokens": jnp.float32(640.0)})
        writer.write(3, {"loss": jnp.float32(1.25), "tokens": jnp.float32(320.0)})
        assert [r["step"] for r in read_jsonl(tmp_path / JSONL_NAME)] == [2]
    records = read_jsonl(tmp_path / JSONL_NAME)
    assert [r["step"] for r in records] == [2, 3]
    assert records[0]["loss"] == 2.5 and records[1]["loss"] == 1.25
    assert records[1]["tokens_per_second"] == pytest.approx(320.0 / records[1]["step_time_s"])


def test_non_scalar_metric_is_rejected(tmp_path):
    with MetricsWriter(tmp_path, QUIET) as writer:
        writer.write(1, {"loss": jnp.ones((3,))})
        with pytest.raises(ValueError, match=r"shape \(3,\)"):
            writer.flush()


def test_resume_keeps_lines_up_to_the_checkpoint_and_drops_later_and_torn_ones(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6)]
    path = tmp_path / JSONL_NAME
    path.write_text("".join(lines) + '{"step": 6, "lo')  # torn by a kill
    with MetricsWriter(tmp_path, QUIET, resume_step=3) as writer:
        assert path.read_text() == "".join(lines[:3])
        writer.write(4, {"loss": jnp.float32(0.5)})
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4]
    assert path.read_text().startswith("".join(lines[:3]))


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    cfg = MetricsConfig(progress_bar=False)
    with MetricsWriter(tmp_path, cfg) as writer:
        for step in (1, 2):
            writer.write(step, {"loss": jnp.float32(step / 4)})
    with MetricsWriter(tmp_path, cfg, resume_step=1) as writer:
        writer.write(2, {"loss": jnp.float32(0.375)})
    events = read_events(tmp_path)
    losses = [(e.step, v.simple_value) for e in events for v in e.summary.value if v.tag == "loss"]
    assert losses == [(1, 0.25), (2, 0.5), (2, 0.375)]
    purges = [
        e.step
        for e in events
        if e.HasField("session_log") and e.session_log.status == event_pb2.SessionLog.START
    ]
    assert purges == [2]  # TensorBoard drops the first run's events from step 2 on


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_enabled_without_wandb_warns_and_still_logs(tmp_path):
    with pytest.warns(UserWarning, match="wandb package is not installed"):
        writer = MetricsWriter(
            tmp_path, MetricsConfig(wandb=True, tensorboard=False, progress_bar=False)
        )
    with writer:
        writer.write(1, {"loss": jnp.float32(1.0)})
    assert read_jsonl(tmp_path / JSONL_NAME)[0]["loss"] == 1.0


def test_progress_bar_starts_at_the_resumed_step_and_shows_metrics():
    out = io.StringIO()
    bar = ProgressBar(10, initial_step=3, file=out)
    bar.advance_to(5)
    bar.show({"loss": 0.123456, "learning_rate": 3e-4, "other": 1.0})
    bar.advance_to(6)
    assert bar.step == 6
    bar.close()
    text = out.getvalue()
    assert "6/10" in text and "loss=0.1235" in text and "learning_rate=0.0003" in text
    assert "other" not in text
    with pytest.raises(ValueError, match="initial_step=11"):
        ProgressBar(10, initial_step=11, file=out)


def test_writer_drives_the_progress_bar(tmp_path, capsys):
    with MetricsWriter(tmp_path, MetricsConfig(tensorboard=False), total_steps=4) as writer:
        for step in range(1, 5):
            writer.write(step, {"loss": jnp.float32(step)})
    err = capsys.readouterr().err
    assert "4/4" in err and "loss=4" in err
