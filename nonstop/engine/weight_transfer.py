"""Weights on the wire: a trainer's NNX parameter state as one safetensors blob with Hugging Face
names and layouts, and back into a serving engine's model.

    blob = encode_weights(graphdef, params, rest, np.dtype("float32"))   # trainer side
    state = decode_weights(model, blob)                                   # server side
    engine.update_weights(state, version)

The blob is what `RemoteEngine.update_weights` sends to `nonstop serve` (`POST
/nonstop/weights`, as the request body or through POSIX shared memory on one host); the
names and layouts are the ones `save_pretrained` writes, so any server that loads Hugging Face
checkpoints can read it. LoRA adapters and quantized weights are merged before encoding.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save as save_safetensors

from nonstop.models.hf_weights import weight_specs
from nonstop.models.lora import merge_lora
from nonstop.models.placement import host_layout
from nonstop.models.safetensors_io import CheckpointError, load_blob


class WeightsMismatchError(ValueError):
    """A weights blob does not fit the model it is loaded into (names, shapes)."""


def hf_weights(
    graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, dtype: np.dtype
) -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face (name, host array) of every tensor of the model `graphdef` with
    `params` (adapters and quantized weights merged into plain ones), cast to `dtype`."""
    model = nnx.merge(graphdef, params, rest)
    merge_lora(model)  # a no-op without adapters or quantized weights
    flat = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for spec in weight_specs(model.cfg):
        value = np.asarray(jax.device_get(flat[spec.path].get_value()))
        # The transpose into Hugging Face's layout through the checkpoint loader's blocked copy
        # (numpy's own is several times slower for bfloat16).
        yield spec.hf_name, host_layout(spec.to_hf(value), dtype, borrowed=False)


def encode_weights(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State,
                   dtype: np.dtype) -> bytes:
    """`params` as one safetensors blob (Hugging Face names and layouts, cast to `dtype`)."""
    return save_safetensors(dict(hf_weights(graphdef, params, rest, np.dtype(dtype))))


def decode_weights(model: nnx.Module, blob: bytes | bytearray | memoryview) -> nnx.State:
    """The `nnx.Param` state of `model` with every tensor taken from the safetensors `blob`,
    cast to the model's own dtypes. Raises `WeightsMismatchError` naming the first tensor that
    is missing, unexpected or of the wrong shape, or a blob that is not safetensors (the model
    is never touched). bfloat16 blobs load (`safetensors.numpy.load` cannot read them)."""
    try:
        tensors = load_blob(blob)
    except CheckpointError as error:
        raise WeightsMismatchError(str(error)) from error
    specs = weight_specs(model.cfg)
    expected = {spec.hf_name for spec in specs}
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise WeightsMismatchError(
            f"the weights hold {len(unexpected)} tensor(s) this model does not have, e.g. "
            f"{unexpected[0]!r}; were they encoded from another architecture?")
    arrays: dict[tuple, np.ndarray] = {}
    for spec in specs:
        if spec.hf_name not in tensors:
            raise WeightsMismatchError(f"the weights lack tensor {spec.hf_name!r}")
        array = tensors[spec.hf_name]
        if tuple(array.shape) != spec.hf_shape:
            raise WeightsMismatchError(
                f"tensor {spec.hf_name!r} has shape {tuple(array.shape)}; this model needs "
                f"{spec.hf_shape}")
        arrays[tuple(spec.path)] = spec.to_ours(array)

    def take(key_path: tuple, current: jax.Array) -> np.ndarray:
        path = tuple(k.key for k in key_path if isinstance(k, jax.tree_util.DictKey))
        if path not in arrays:
            raise WeightsMismatchError(f"the weights lack parameter {'.'.join(map(str, path))}")
        return np.asarray(arrays[path], dtype=current.dtype)

    return jax.tree_util.tree_map_with_path(take, nnx.state(model, nnx.Param))

__all__ = ["WeightsMismatchError", "decode_weights", "encode_weights", "hf_weights"]
