"""Hugging Face `Gemma3ForConditionalGeneration` checkpoints: weight names, load and save.

Tensor names are written as transformers 5 saves them (`language_model.model.*`,
`vision_tower.*`, `multi_modal_projector.*`); loading also accepts the other layouts in
circulation (`model.language_model.*`, `vision_tower.vision_model.*` of the released Gemma 3
checkpoints, ...) by rewriting their prefixes. As for text models, every expected tensor must be
present with its shape and every tensor present must be used.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from nonstop.models.hf_weights import (
    IGNORED_SUFFIXES,
    WeightSpec,
    _identity,
    _linear,
    _out_proj,
    _reshape,
    weight_specs,
)
from nonstop.models.multimodal import Gemma3VLM, VLMConfig, abstract_vlm
from nonstop.models.placement import place
from nonstop.models.safetensors_io import CheckpointError, SafetensorsReader

# Prefix rewrites from other layouts to the one we write, tried in order.
_ALIASES = (
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("language_model.lm_head.", "lm_head."),
)


def canonical_name(name: str) -> str:
    for old, new in _ALIASES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def vlm_weight_specs(cfg: VLMConfig) -> list[WeightSpec]:
    """Every tensor of a Gemma 3 vision-language checkpoint, with our parameter paths."""
    v = cfg.vision
    D, F, N, H, P, C = (v.hidden_size, v.intermediate_size, v.num_heads, v.head_dim,
                        v.patch_size, v.num_channels)
    specs: list[WeightSpec] = []

    def add(hf_name: str, path: tuple, hf_shape: tuple[int, ...], convert=(_identity, _identity)
            ) -> None:
        specs.append(WeightSpec(hf_name=hf_name, path=path, hf_shape=hf_shape,
                                to_ours=convert[0], to_hf=convert[1]))

    pre, ours = "vision_tower.", ("vision",)
    # HF conv weight [Dv, C, P, P] <-> ours [P, P, C, Dv].
    add(pre + "embeddings.patch_embedding.weight", ours + ("patch_embed",), (D, C, P, P),
        (lambda a: a.transpose(2, 3, 1, 0), lambda a: a.transpose(3, 2, 0, 1)))
    add(pre + "embeddings.patch_embedding.bias", ours + ("patch_bias",), (D,))
    add(pre + "embeddings.position_embedding.weight", ours + ("pos_embed",),
        (v.patches_per_side**2, D))
    for i in range(v.num_layers):
        p, o = f"{pre}encoder.layers.{i}.", ours + ("layers", i)
        for norm_hf, norm in (("layer_norm1", "norm1"), ("layer_norm2", "norm2")):
            add(f"{p}{norm_hf}.weight", o + (norm, "scale"), (D,))
            add(f"{p}{norm_hf}.bias", o + (norm, "bias"), (D,))
        for proj in ("q", "k", "v"):
            add(f"{p}self_attn.{proj}_proj.weight", o + ("attn", f"{proj}_proj"), (D, D),
                _linear((N, H), D))
            add(f"{p}self_attn.{proj}_proj.bias", o + ("attn", f"{proj}_bias"), (D,),
                _reshape((N, H), (D,)))
        add(f"{p}self_attn.out_proj.weight", o + ("attn", "o_proj"), (D, D), _out_proj((N, H), D))
        add(f"{p}self_attn.out_proj.bias", o + ("attn", "o_bias"), (D,))
        add(f"{p}mlp.fc1.weight", o + ("mlp", "fc1"), (F, D), _linear((F,), D))
        add(f"{p}mlp.fc1.bias", o + ("mlp", "fc1_bias"), (F,))
        add(f"{p}mlp.fc2.weight", o + ("mlp", "fc2"), (D, F), _linear((D,), F))
        add(f"{p}mlp.fc2.bias", o + ("mlp", "fc2_bias"), (D,))
    add(pre + "post_layernorm.weight", ours + ("post_norm", "scale"), (D,))
    add(pre + "post_layernorm.bias", ours + ("post_norm", "bias"), (D,))
    add("multi_modal_projector.mm_input_projection_weight", ("projector", "proj"),
        (D, cfg.text.hidden_size))
    add("multi_modal_projector.mm_soft_emb_norm.weight", ("projector", "norm", "scale"), (D,))
    for s in weight_specs(cfg.text, prefix="language_model.model."):
        specs.append(WeightSpec(hf_name=s.hf_name, path=("language_model", *s.path),
                                hf_shape=s.hf_shape, to_ours=s.to_ours, to_hf=s.to_hf))
    return specs


def load_vlm(path: str | Path, *, dtype: jnp.dtype = jnp.float32,
             param_dtype: jnp.dtype | None = None) -> Gemma3VLM:
    """A `Gemma3VLM` with the weights of a local Hugging Face checkpoint directory."""
    path = Path(path)
    cfg = VLMConfig.from_hf(path / "config.json")
    param_dtype = param_dtype or dtype
    specs = {s.hf_name: s for s in vlm_weight_specs(cfg)}
    graphdef, abstract = nnx.split(abstract_vlm(cfg, dtype=dtype, param_dtype=param_dtype))
    flat = {tuple(p): var for p, var in nnx.to_flat_state(abstract)}
    loaded: set[str] = set()
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    with SafetensorsReader(path) as reader:
        for name, entry in reader.entries.items():
            canon = canonical_name(name)
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if canon == "lm_head.weight" and cfg.text.tie_embeddings:
                continue  # tied to the embeddings (transformers may write it anyway)
            spec = specs.get(canon)
            if spec is None:
                raise CheckpointError(f"{entry.file}: unexpected tensor {name!r}: nonstop's "
                                      "Gemma 3 vision-language model has no parameter for it")
            if tuple(entry.shape) != spec.hf_shape:
                raise CheckpointError(f"{entry.file}: tensor {name!r} has shape {entry.shape}, "
                                      f"but config.json implies {spec.hf_shape}")
            flat[spec.path].set_value(place(spec.to_ours(reader.read(name)), np.dtype(param_dtype),
                                            device, borrowed=False))
            loaded.add(canon)
    missing = sorted(set(specs) - loaded)
    if missing:
        raise CheckpointError(f"{path}: tensors missing from the checkpoint: {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
    return nnx.merge(graphdef, abstract)


def save_vlm(model: Gemma3VLM, path: str | Path, *, dtype: jnp.dtype | None = None) -> None:
    """Write `model` as a Hugging Face checkpoint directory that transformers loads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    tensors: dict[str, np.ndarray] = {}
    for spec in vlm_weight_specs(model.vlm_cfg):
        if spec.path not in flat:
            raise CheckpointError(f"parameter {spec.path} is not a plain weight (LoRA or "
                                  "quantized?): merge adapters before saving")
        host = np.asarray(jax.device_get(flat[spec.path].get_value()))
        host = np.ascontiguousarray(spec.to_hf(host))
        tensors[spec.hf_name] = host.astype(dtype) if dtype is not None else host
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = model.vlm_cfg.to_hf()
    hf["dtype"] = str(next(iter(tensors.values())).dtype)
    (path / "config.json").write_text(json.dumps(hf, indent=2))


__all__ = ["canonical_name", "load_vlm", "save_vlm", "vlm_weight_specs"]
