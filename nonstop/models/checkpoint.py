"""Load and save Hugging Face checkpoint directories (config.json + safetensors).

`load_pretrained` builds the decoder with shape-only parameters, then reads each tensor from the
safetensors files and places it on its sharding in our layout and the parameter dtype
(`placement.place_all`: transposed on the host for CPU devices, on the devices otherwise;
`jax.make_array_from_callback`, so each device receives only its own shard). A thread reads the
next tensor while one is placed, and the shape-only model is built while the first is read; at
most two tensors are in flight on the host.
Every expected tensor must be present with its expected shape, and every tensor present must be
used: anything else is an error naming the tensor and the file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, Sharding
from safetensors.numpy import save_file

from nonstop.models.config import ModelConfig
from nonstop.models.decoder import Decoder, abstract_decoder
from nonstop.models.hf_weights import IGNORED_SUFFIXES, WeightSpec, weight_specs
from nonstop.models.multimodal import Gemma3VLM, is_vlm_config
from nonstop.models.placement import host_layout, place_all
from nonstop.models.safetensors_io import CheckpointError, SafetensorsReader
from nonstop.models.sharding import DEFAULT_RULES, ShardingRules

log = logging.getLogger(__name__)


def _check_tensors(reader: SafetensorsReader, specs: list[WeightSpec], cfg: ModelConfig) -> None:
    expected = {s.hf_name for s in specs}
    for spec in specs:
        entry = reader.entries.get(spec.hf_name)
        if entry is None:
            raise CheckpointError(f"{reader.directory}: tensor {spec.hf_name!r} is missing from the "
                                  f"checkpoint's safetensors files "
                                  f"({sorted({e.file.name for e in reader.entries.values()})})")
        if entry.shape != spec.hf_shape:
            raise CheckpointError(f"{entry.file}: tensor {spec.hf_name!r} has shape {entry.shape}, "
                                  f"but config.json implies {spec.hf_shape}")
    for name, entry in reader.entries.items():
        if name in expected or name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and cfg.tie_embeddings:
            log.warning("%s: ignoring lm_head.weight: config.json ties it to the embeddings",
                        entry.file)
            continue
        raise CheckpointError(f"{entry.file}: unexpected tensor {name!r}: nonstop's "
                              f"{cfg.family} decoder has no parameter for it")


def load_pretrained(path: str | Path, *, dtype: jnp.dtype = jnp.float32,
                    param_dtype: jnp.dtype | None = None, mesh: Mesh | None = None,
                    rules: ShardingRules = DEFAULT_RULES) -> Decoder | Gemma3VLM:
    """A `Decoder` (or, for a Gemma 3 vision-language checkpoint, a `Gemma3VLM`) with the
    weights of a local Hugging Face checkpoint directory.

    `dtype` is the compute dtype; parameters are stored in `param_dtype` (default: `dtype`).
    With a `mesh`, each parameter lands on the sharding its logical axes map to.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; pass a local Hugging Face checkpoint")
    if (path / "config.json").exists() and is_vlm_config(json.loads(
            (path / "config.json").read_text())):
        from nonstop.models.sharding import shard_model
        from nonstop.models.vlm_checkpoint import load_vlm  # Gemma 3 with its vision tower
        vlm = load_vlm(path, dtype=dtype, param_dtype=param_dtype)
        return vlm if mesh is None else shard_model(vlm, mesh, rules)
    cfg = ModelConfig.from_hf(path / "config.json")
    param_dtype = param_dtype or dtype
    specs = weight_specs(cfg)
    devices = jax.local_devices()[:1] if mesh is None else list(mesh.devices.flat)
    built: dict = {}  # the shape-only model, made while the first tensor is read

    def shardings() -> Iterator[Sharding]:
        graphdef, abstract = nnx.split(abstract_decoder(cfg, dtype=dtype,
                                                        param_dtype=param_dtype))
        variables = dict((tuple(p), v) for p, v in nnx.to_flat_state(abstract))
        unmatched = set(variables) ^ {s.path for s in specs}
        if unmatched:
            raise CheckpointError(f"internal: parameters and checkpoint tensors differ at "
                                  f"{sorted(unmatched)}")
        built.update(graphdef=graphdef, abstract=abstract,
                     variables=[variables[s.path] for s in specs])
        for var in built["variables"]:
            if mesh is None:
                yield jax.sharding.SingleDeviceSharding(devices[0])
            else:
                yield NamedSharding(mesh, rules.spec(var.logical_axes, var.get_value().shape,
                                                     mesh))

    with SafetensorsReader(path) as reader:
        _check_tensors(reader, specs, cfg)
        arrays = place_all(reader, [(s.hf_name, s.to_ours) for s in specs], shardings(),
                           np.dtype(param_dtype), on_cpu=all(d.platform == "cpu" for d in devices))
        for i, array in enumerate(arrays):
            built["variables"][i].set_value(array)
    return nnx.merge(built["graphdef"], built["abstract"])


def save_pretrained(model: Decoder | Gemma3VLM, path: str | Path, *,
                    dtype: jnp.dtype | None = None, max_shard_bytes: int = 2 * 1024**3) -> None:
    """Write `model` as a Hugging Face checkpoint directory that transformers loads.

    Tensors are written in `dtype` (default: the parameters' own), split into shards of at most
    `max_shard_bytes` with a `model.safetensors.index.json` when there is more than one.
    """
    if isinstance(model, Gemma3VLM):
        from nonstop.models.vlm_checkpoint import save_vlm
        return save_vlm(model, path, dtype=dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    specs = {s.path: s for s in weight_specs(cfg)}
    state = nnx.state(model, nnx.Param)
    flat = {tuple(p): v for p, v in nnx.to_flat_state(state)}
    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    saved_dtype = None
    for spec_path, spec in specs.items():
        value = np.asarray(jax.device_get(flat[spec_path].get_value()))
        host = host_layout(spec.to_hf(value), np.dtype(dtype or value.dtype), borrowed=False)
        saved_dtype = host.dtype
        if sizes[-1] and sizes[-1] + host.nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][spec.hf_name] = host
        sizes[-1] += host.nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf = cfg.to_hf()
    hf["dtype"] = str(np.dtype(saved_dtype)) if saved_dtype is not None else "float32"
    (path / "config.json").write_text(json.dumps(hf, indent=2))


__all__ = ["CheckpointError", "load_pretrained", "save_pretrained"]
