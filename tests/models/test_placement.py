"""Placing checkpoint tensors: the file's bytes, transposed to our layout on host or device."""

from __future__ import annotations

import os

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from nonstop.models import make_mesh
from nonstop.models.hf_weights import _linear, _out_proj
from nonstop.models.placement import as_stored, place, transposed
from nonstop.models.safetensors_io import CheckpointError, SafetensorsReader, aligned_buffer

N, H, D, F = 4, 6, 10, 14  # N and D split over tp=4 and fsdp=2 below

LAYOUTS = {  # name: (Hugging Face shape, to_ours)
    "q_proj": ((N * H, D), _linear((N, H), D)[0]),
    "o_proj": ((D, N * H), _out_proj((N, H), D)[0]),
    "gate_proj": ((F, D), _linear((F,), D)[0]),
    "conv": ((D, 3, 5, 5), lambda a: a.transpose(2, 3, 1, 0)),  # not a 2-D transpose
    "norm": ((D,), lambda a: a),
}


def _hf(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("name", LAYOUTS)
def test_as_stored_recovers_the_buffer_without_copying(name):
    shape, to_ours = LAYOUTS[name]
    hf = _hf(shape)
    ours = to_ours(hf)
    stored, perm = as_stored(ours)
    assert np.shares_memory(stored, hf) and stored.flags.c_contiguous
    np.testing.assert_array_equal(stored.transpose(perm), ours)
    out = transposed(stored, perm)
    assert out.flags.c_contiguous and out.ctypes.data % 64 == 0
    np.testing.assert_array_equal(out, ours)


@pytest.mark.parametrize("on_host", [True, False])
@pytest.mark.parametrize("name", LAYOUTS)
def test_place_matches_numpy_on_a_mesh(name, on_host):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    shape, to_ours = LAYOUTS[name]
    hf = _hf(shape, ml_dtypes.bfloat16)
    ours = to_ours(hf)
    mesh = make_mesh(fsdp=2, tp=4)
    # D over fsdp and N over tp, wherever our layout puts them.
    spec = PartitionSpec(*({D: "fsdp", N: "tp"}.get(n) for n in ours.shape))
    sharding = NamedSharding(mesh, spec)
    for dtype in (ml_dtypes.bfloat16, np.float32):
        got = place(ours, np.dtype(dtype), sharding, borrowed=False, on_host=on_host)
        assert got.dtype == dtype and got.shape == ours.shape
        assert got.sharding.is_equivalent_to(sharding, ours.ndim)
        np.testing.assert_array_equal(np.asarray(got), ours.astype(dtype))


@pytest.mark.parametrize("on_host", [True, False])
def test_borrowed_buffer_can_be_overwritten_after_placing(on_host):
    """JAX's CPU client adopts aligned host arrays: a borrowed buffer must not become the result."""
    shape, to_ours = LAYOUTS["norm"]
    buffer = aligned_buffer(D * 4)
    hf = buffer.view(np.float32).reshape(shape)
    hf[...] = np.arange(D)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    got = place(to_ours(hf), np.dtype(np.float32), device, borrowed=True, on_host=on_host)
    buffer[...] = 0
    np.testing.assert_array_equal(np.asarray(got), np.arange(D, dtype=np.float32))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("layout", ["q_proj", "o_proj"])
def test_large_transposes_split_over_threads_equal_numpy(dtype, layout):
    """Big enough for the threaded path (row ranges of unequal size: 1009 rows is prime)."""
    big = (1009, 67 * 4) if layout == "q_proj" else (67 * 4, 1009)
    hf = _hf(big, dtype, seed=3)
    stored, perm = as_stored(hf.T)
    got = transposed(stored, perm)
    assert got.ctypes.data % 64 == 0 and got.flags.c_contiguous
    np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(hf.T).view(np.uint8))


@pytest.mark.parametrize("dtype", [np.uint8, ml_dtypes.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(300, 24), (300, 26), (130, 4096), (1, 8), (257, 1)])
def test_two_pass_transpose_equals_numpy_at_every_edge(dtype, shape):
    """Word-wise passes when whole 8-byte words fit a row (24 = 3 words of bf16, 26 does not
    split), chunk ends that are not multiples of the block (300 rows over chunks of 128), the
    threaded path (130 x 4096), and degenerate shapes; into a given buffer and a fresh one."""
    hf = _hf(shape, seed=5).astype(dtype) if dtype != np.uint8 else (
        np.random.default_rng(5).integers(0, 255, shape, dtype=np.uint8))
    expected = np.ascontiguousarray(hf.T)
    into = aligned_buffer(hf.nbytes)
    got = transposed(hf, (1, 0), into)
    assert np.shares_memory(got, into)
    np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
    np.testing.assert_array_equal(transposed(hf, (1, 0)).view(np.uint8), expected.view(np.uint8))


def _write_shard(path, tensors):
    from safetensors.numpy import save_file

    save_file(tensors, str(path / "model.safetensors"))


def test_mapped_view_equals_the_read_bytes_and_cannot_be_written(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {"a": rng.standard_normal((3, 5), np.float32),  # at an offset that no page starts
               "b": rng.integers(-9, 9, (4096, 3), np.int16), "empty": np.zeros((0, 4), np.float32)}
    _write_shard(tmp_path, tensors)
    with SafetensorsReader(tmp_path) as reader:
        for name, expected in tensors.items():
            view = reader.mapped(name)
            assert view.dtype == expected.dtype and view.shape == expected.shape
            np.testing.assert_array_equal(view, expected)
            np.testing.assert_array_equal(view, reader.read(name))
        with pytest.raises(ValueError, match="read-only"):
            reader.mapped("b")[0, 0] = 1


def test_a_file_truncated_after_opening_is_an_error_not_a_fault(tmp_path):
    tensors = {"a": np.arange(12, dtype=np.float32), "b": np.arange(4096, dtype=np.float32)}
    _write_shard(tmp_path, tensors)
    with SafetensorsReader(tmp_path) as reader:
        last = max(reader.entries, key=lambda name: reader.entries[name].end)
        os.truncate(tmp_path / "model.safetensors", reader.entries[last].end - 4)
        with pytest.raises(CheckpointError, match=rf"truncated since it was opened: tensor '{last}'"):
            reader.mapped(last)
