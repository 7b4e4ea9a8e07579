"""LoRA adapters as PEFT adapter directories, the format transformers, PEFT and vLLM load.

    save_adapters(model, "out/adapters", base_model_name_or_path="Qwen/Qwen3-0.6B")
    model = load_adapters(load_pretrained(base_dir), "out/adapters")

A directory holds `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors`, one pair of tensors per adapted projection, named as PEFT saves them:
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r], where
`<module>` is the projection's Hugging Face module (`model.layers.0.self_attn.q_proj`). The
module names and the [out, in] shapes come from `hf_weights.weight_specs`, the table the
checkpoint loader uses. PEFT's update is scale·B·A on [out, in] weights; ours is scale·A·B on
[*in, *out] einsum layouts, so A [*in, r] becomes [r, prod(in)] and B [r, *out] becomes
[prod(out), r], flattening the head axes row-major exactly as `weight_specs` flattens q/k/v/o.

Loading is strict: every tensor the config implies must be present with its shape, every tensor
present must be used, and PEFT options nonstop's `LoRAWeight` cannot express (DoRA, per-module
ranks, trained biases, layer subsets, extra saved modules) are refused naming the file and key.
`use_rslora` (scale alpha/sqrt(r)) is read as the equivalent alpha. Adapters of the Gemma 3
vision-language model are not covered: merge them and `save_pretrained` instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from nonstop.models.decoder import Decoder
from nonstop.models.hf_weights import WeightSpec, weight_specs
from nonstop.models.lora import LoRAConfig, LoRAWeight, apply_lora, has_lora
from nonstop.models.multimodal import Gemma3VLM
from nonstop.models.quantize import PROJECTIONS
from nonstop.models.safetensors_io import CheckpointError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel wraps the *ForCausalLM as base_model.model

# Keys of adapter_config.json whose non-default values nonstop cannot honour.
_MUST_BE_EMPTY = ("rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern",
                  "modules_to_save", "layer_replication", "target_parameters",
                  "trainable_token_indices", "exclude_modules")
_MUST_BE_FALSE = ("use_dora", "fan_in_fan_out", "lora_bias")


def _sites(model: Decoder) -> Iterator[tuple[WeightSpec, nnx.Module, str]]:
    """(spec, owning module, projection name) for every projection LoRA can wrap."""
    for spec in weight_specs(model.cfg):
        if spec.path[0] == "layers" and spec.path[-1] in PROJECTIONS:
            _, index, owner_name, name = spec.path
            yield spec, getattr(model.layers[index], owner_name), name


def _peft_names(spec: WeightSpec) -> tuple[str, str]:
    module = PEFT_PREFIX + spec.hf_name.removesuffix(".weight")
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def _check_text_model(model: Any, what: str) -> None:
    if isinstance(model, Gemma3VLM):
        raise TypeError(f"{what}: adapters of the Gemma 3 vision-language model are not supported "
                        "in PEFT format; merge them (merge_lora, merge_vision_lora) and "
                        "save_pretrained the merged model instead")
    if not isinstance(model, Decoder):
        raise TypeError(f"{what}: expected a nonstop Decoder, got {type(model).__name__}")


def _host(value: jax.Array) -> np.ndarray:
    return np.asarray(jax.device_get(value))


def save_adapters(model: Decoder, directory: str | Path, *,
                  base_model_name_or_path: str | None = None,
                  dtype: np.dtype | None = None) -> Path:
    """Write the model's LoRA adapters as a PEFT adapter directory; returns the directory.

    `dtype` (default: the adapters' own) is the tensors' dtype on disk.
    """
    _check_text_model(model, "save_adapters")
    found = [(spec, getattr(owner, name), name) for spec, owner, name in _sites(model)
             if isinstance(getattr(owner, name), LoRAWeight)]
    if not found:
        raise ValueError("save_adapters: the model has no LoRA adapters (apply_lora adds them); "
                         "save a fully fine-tuned model with save_pretrained")
    targets = sorted({name for _, _, name in found}, key=list(PROJECTIONS).index)
    if len(found) != len(targets) * model.cfg.num_layers:
        raise ValueError(f"save_adapters: adapters on {targets} are not on every layer; PEFT's "
                         "target_modules adapts a projection in every layer")
    ranks = {w.lora_a.get_value().shape[-1] for _, w, _ in found}
    scales = {w.scale for _, w, _ in found}
    dropouts = {w.dropout.rate if w.dropout is not None else 0.0 for _, w, _ in found}
    if len(ranks) > 1 or len(scales) > 1 or len(dropouts) > 1:
        raise ValueError(f"save_adapters: adapters differ in rank {sorted(ranks)}, scale "
                         f"{sorted(scales)} or dropout {sorted(dropouts)}; PEFT's "
                         "adapter_config.json holds one of each")
    rank, scale, dropout = ranks.pop(), scales.pop(), dropouts.pop()
    tensors: dict[str, np.ndarray] = {}
    for spec, weight, _ in found:
        a, b = _host(weight.lora_a.get_value()), _host(weight.lora_b.get_value())
        name_a, name_b = _peft_names(spec)
        tensors[name_a] = np.ascontiguousarray(a.reshape(-1, rank).T)  # [*in, r] -> [r, in]
        tensors[name_b] = np.ascontiguousarray(b.reshape(rank, -1).T)  # [r, *out] -> [out, r]
        for name, expected in ((name_a, (rank, spec.hf_shape[1])),
                               (name_b, (spec.hf_shape[0], rank))):
            if tensors[name].shape != expected:  # the layouts and weight_specs disagree
                raise AssertionError(f"internal: {name} has shape {tensors[name].shape}, "
                                     f"expected {expected}")
            if dtype is not None:
                tensors[name] = tensors[name].astype(dtype)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    alpha = scale * rank
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "exclude_modules": None,
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return directory


def read_adapter_config(directory: str | Path) -> LoRAConfig:
    """The `LoRAConfig` an adapter directory's adapter_config.json describes (strictly checked)."""
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; a PEFT adapter directory holds "
                              f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None

    def refuse(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{path}: {key}={raw.get(key)!r}: {why}")

    if raw.get("peft_type") != "LORA":
        raise refuse("peft_type", "only LORA adapters can be loaded")
    if raw.get("bias", "none") != "none":
        raise refuse("bias", "nonstop's LoRA trains no biases; only bias='none' loads")
    for key in _MUST_BE_FALSE:
        if raw.get(key):
            raise refuse(key, "not supported by nonstop's LoRAWeight")
    for key in _MUST_BE_EMPTY:
        if raw.get(key):
            raise refuse(key, "not supported: nonstop adapts the same projections of every "
                         "layer with one rank and alpha")
    for key in ("r", "lora_alpha"):
        if not isinstance(raw.get(key), int | float) or raw[key] <= 0:
            raise refuse(key, "expected a positive number")
    if int(raw["r"]) != raw["r"]:
        raise refuse("r", "expected an integer rank")
    modules = raw.get("target_modules")
    if modules == "all-linear":
        targets = tuple(PROJECTIONS)
    elif isinstance(modules, list) and modules:
        targets = tuple(m.rsplit(".", 1)[-1] for m in modules)
        unknown = sorted(set(targets) - set(PROJECTIONS))
        if unknown:
            raise refuse("target_modules", f"{unknown} are not projections nonstop can adapt; "
                         f"valid: {list(PROJECTIONS)}")
        targets = tuple(sorted(set(targets), key=list(PROJECTIONS).index))
    else:
        raise refuse("target_modules", "expected a list of projection names or 'all-linear'")
    rank = int(raw["r"])
    scale = raw["lora_alpha"] / (math.sqrt(rank) if raw.get("use_rslora") else rank)
    dropout = float(raw.get("lora_dropout") or 0.0)
    return LoRAConfig(rank=rank, alpha=scale * rank, dropout=dropout, targets=targets)


def load_adapters(model: Decoder, directory: str | Path, *, seed: int = 0) -> Decoder:
    """Set the model's LoRA adapters from a PEFT adapter directory (in place; returns `model`).

    A model without adapters gets them first (`apply_lora` with the directory's config; `seed`
    only seeds dropout). A model that has adapters must have them on the same projections with
    the same rank and scale.
    """
    _check_text_model(model, "load_adapters")
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory; pass a PEFT adapter directory "
                              f"({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
    cfg = read_adapter_config(directory)
    weights_path = directory / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        other = " (adapter_model.bin is not read: re-save with safe_serialization)" if (
            directory / "adapter_model.bin").exists() else ""
        raise CheckpointError(f"{weights_path}: not found{other}")
    if has_lora(model):
        _check_existing(model, cfg, directory / ADAPTER_CONFIG)
    else:
        apply_lora(model, cfg, seed=seed)
    with safe_open(str(weights_path), framework="numpy") as handle:
        present = set(handle.keys())
        used = set()
        for spec, owner, name in _sites(model):
            if name not in cfg.targets:
                continue
            weight: LoRAWeight = getattr(owner, name)
            n_in = weight.n_in
            in_shape, out_shape = weight.shape[:n_in], weight.shape[n_in:]
            name_a, name_b = _peft_names(spec)
            for key, expected in ((name_a, (cfg.rank, spec.hf_shape[1])),
                                  (name_b, (spec.hf_shape[0], cfg.rank))):
                if key not in present:
                    raise CheckpointError(f"{weights_path}: tensor {key!r} is missing; "
                                          f"{ADAPTER_CONFIG} targets {list(cfg.targets)} in "
                                          f"every one of the model's {model.cfg.num_layers} "
                                          "layers")
                shape = tuple(handle.get_slice(key).get_shape())
                if shape != expected:
                    raise CheckpointError(f"{weights_path}: tensor {key!r} has shape {shape}, but "
                                          f"the base model and r={cfg.rank} imply {expected}")
            a = handle.get_tensor(name_a).T.reshape(*in_shape, cfg.rank)
            b = handle.get_tensor(name_b).T.reshape(cfg.rank, *out_shape)
            _assign(weight.lora_a, a)
            _assign(weight.lora_b, b)
            used |= {name_a, name_b}
        unused = sorted(present - used)
        if unused:
            raise CheckpointError(f"{weights_path}: unexpected tensor {unused[0]!r} "
                                  f"({len(unused)} unused in all): nonstop's {model.cfg.family} "
                                  f"decoder with targets {list(cfg.targets)} has no place for it")
    return model


def _check_existing(model: Decoder, cfg: LoRAConfig, config_path: Path) -> None:
    weights = {name: getattr(owner, name) for _, owner, name in _sites(model)}
    adapted = tuple(n for n in PROJECTIONS if isinstance(weights.get(n), LoRAWeight))
    if adapted != cfg.targets:
        raise CheckpointError(f"{config_path}: target_modules {list(cfg.targets)} differ from the "
                              f"model's adapted projections {list(adapted)}; load onto a model "
                              "without adapters, or apply_lora with the same targets")
    some = weights[adapted[0]]
    rank = some.lora_a.get_value().shape[-1]
    if rank != cfg.rank or not math.isclose(some.scale, cfg.scale, rel_tol=1e-6):
        raise CheckpointError(f"{config_path}: r={cfg.rank}, scale {cfg.scale:g} differ from the "
                              f"model's adapters (rank {rank}, scale {some.scale:g})")


def _assign(variable: nnx.Variable, host: np.ndarray) -> None:
    current = variable.get_value()
    value = jnp.asarray(host, dtype=current.dtype)
    sharding = getattr(current, "sharding", None)
    variable.set_value(jax.device_put(value, sharding) if sharding is not None else value)


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "load_adapters", "read_adapter_config",
           "save_adapters"]
