"""Translation between Hugging Face `config.json` dicts and `ModelConfig`.

Reads both the transformers 4.x layout (`rope_theta`, `rope_scaling`) and the 5.x layout
(`rope_parameters`, per layer type for Gemma 3). Every key is either understood, known to be
harmless metadata, or required to hold the value we implement; anything else is an error that
names the key and the file, so a checkpoint never loads with a feature silently dropped.
"""

from __future__ import annotations

from typing import Any

from nonstop.models.config import ConfigError, Family, LayerType, ModelConfig, RopeConfig
from nonstop.models.presets import family_switches, gemma2_layer_types, gemma3_layer_types

MODEL_TYPES: dict[str, Family] = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2",
    "gemma3_text": "gemma3", "gemma3": "gemma3",
}
ARCHITECTURES: dict[Family, str] = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
}
HF_MODEL_TYPE: dict[Family, str] = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2",
    "gemma3": "gemma3_text",
}

# Keys that carry no architecture: bookkeeping, training-only or generation defaults.
_METADATA = {
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label",
    "label2id", "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states",
    "problem_type", "return_dict", "transformers_version", "initializer_range", "use_cache",
    "tie_word_embeddings", "_sliding_window_pattern", "sliding_window_pattern", "max_window_layers",
    "cache_implementation", "final_logit_softcapping", "attn_logit_softcapping", "bos_token_id",
    "eos_token_id", "pad_token_id", "model_name", "quantization_config_ignored",
}
# Keys whose value must equal the one we implement (value, what it means).
_REQUIRED = {
    "attention_dropout": (0.0, "attention dropout"),
    "mlp_bias": (False, "bias on the MLP projections"),
    "pretraining_tp": (1, "tensor-parallel pretraining slices"),
    "use_sliding_window": (False, "Qwen sliding-window attention"),
    "use_bidirectional_attention": (None, "bidirectional attention"),
    "partial_rotary_factor": (1.0, "partial rotary embeddings"),
    "rope_interleaved": (False, "interleaved rotary embeddings"),
}
_HANDLED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "rope_local_base_freq", "attention_bias", "hidden_act",
    "hidden_activation", "sliding_window", "layer_types", "query_pre_attn_scalar",
}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh", "gelu": "gelu"}


def _fail(source: str, key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{source}: config field {key!r} = {value!r}: {why}")


def _need(hf: dict[str, Any], key: str, source: str, within: str | None = None) -> Any:
    """`hf[key]`, or an error naming the file and the missing key (`within`: the enclosing key)."""
    if key not in hf:
        name = f"{within}.{key}" if within else key
        raise ConfigError(f"{source}: required config field {name!r} is missing")
    return hf[key]


def _rope_from_hf(params: dict[str, Any], theta: float | None, source: str, key: str) -> RopeConfig:
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    theta = float(params.get("rope_theta", theta if theta is not None else 10_000.0))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear",
                          factor=float(_need(params, "factor", source, key)))
    if kind == "llama3":
        return RopeConfig(
            theta=theta, kind="llama3", factor=float(_need(params, "factor", source, key)),
            low_freq_factor=float(_need(params, "low_freq_factor", source, key)),
            high_freq_factor=float(_need(params, "high_freq_factor", source, key)),
            original_max_position_embeddings=int(
                _need(params, "original_max_position_embeddings", source, key)),
        )
    raise _fail(source, key, params, f"RoPE scaling type {kind!r} is not supported "
                                     "(supported: default, linear, llama3)")


def _ropes(hf: dict[str, Any], family: Family, source: str) -> tuple[RopeConfig, RopeConfig | None]:
    theta = hf.get("rope_theta")
    local: RopeConfig | None = None
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5, per layer type
        rope = _rope_from_hf(params["full_attention"], theta, source, "rope_parameters")
        if "sliding_attention" in params:
            local = _rope_from_hf(params["sliding_attention"], None, source, "rope_parameters")
    elif isinstance(params, dict):
        rope = _rope_from_hf(params, theta, source, "rope_parameters")
    else:
        rope = _rope_from_hf(hf.get("rope_scaling") or {}, theta, source, "rope_scaling")
    if family == "gemma3" and local is None:
        local = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10_000.0)))
    return rope, local


def _layer_types(hf: dict[str, Any], family: Family, n: int, source: str) -> tuple[LayerType, ...]:
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    if hf.get("layer_types"):
        out = []
        for t in hf["layer_types"]:
            if t not in names:
                raise _fail(source, "layer_types", t, "supported layer types are "
                                                      f"{sorted(names)}")
            out.append(names[t])
        if family in ("llama", "qwen2", "qwen3", "gemma") and "sliding" in out:
            raise _fail(source, "layer_types", hf["layer_types"],
                        f"sliding-window layers are not supported for {family}")
        return tuple(out)  # type: ignore[arg-type]
    if family == "gemma2":
        return gemma2_layer_types(n)
    if family == "gemma3":
        return gemma3_layer_types(n, int(hf.get("sliding_window_pattern", 6)))
    return ("full",) * n


def config_from_hf(hf: dict[str, Any], *, source: str = "<dict>") -> ModelConfig:
    """Build a `ModelConfig` from a config.json dict; `source` names the file in errors."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise _fail(source, "model_type", model_type,
                    f"unknown architecture; supported model types: {sorted(MODEL_TYPES)}")
    if model_type == "gemma3":  # the multimodal wrapper: the language model is text_config
        hf = {**_need(hf, "text_config", source), "model_type": "gemma3_text"}
    family = MODEL_TYPES[model_type]
    for arch in hf.get("architectures") or []:
        if not arch.endswith("ForCausalLM") and arch != "Gemma3ForConditionalGeneration":
            raise _fail(source, "architectures", arch, "only causal language models load here")
    for key, value in hf.items():
        if key in _METADATA or key in _HANDLED:
            continue
        if key in _REQUIRED:
            expected, meaning = _REQUIRED[key]
            if value != expected and not (value is False and expected is None):
                raise _fail(source, key, value, f"{meaning} is not supported (need {expected!r})")
            continue
        if key == "sliding_window" or key.startswith("_"):
            continue
        raise _fail(source, key, value, "this field is not supported by nonstop's decoder; "
                                        "remove it only if it does not change the model")
    if hf.get("attention_bias") and family != "qwen2":
        raise _fail(source, "attention_bias", True,
                    f"attention projection bias is only supported for qwen2, not {family}")
    switches = family_switches(family)
    act_name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act_name not in _ACTIVATIONS:
        raise _fail(source, "hidden_act", act_name, f"supported: {sorted(_ACTIVATIONS)}")
    n_layers = int(_need(hf, "num_hidden_layers", source))
    n_heads = int(_need(hf, "num_attention_heads", source))
    layer_types = _layer_types(hf, family, n_layers, source)
    rope, local_rope = _ropes(hf, family, source)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    hidden_size = int(_need(hf, "hidden_size", source))
    return ModelConfig(
        family=family,
        vocab_size=int(_need(hf, "vocab_size", source)),
        hidden_size=hidden_size,
        intermediate_size=int(_need(hf, "intermediate_size", source)),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or hidden_size // n_heads),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope,
        local_rope=local_rope,
        attention_bias=family == "qwen2",
        qk_norm=switches.get("qk_norm", False),
        norm_plus_one=switches.get("norm_plus_one", False),
        scale_embeddings=switches.get("scale_embeddings", False),
        activation=_ACTIVATIONS[act_name],  # type: ignore[arg-type]
        post_norms=switches.get("post_norms", False),
        attn_softcap=hf.get("attn_logit_softcapping"),
        final_softcap=hf.get("final_logit_softcapping"),
        query_pre_attn_scalar=(float(hf["query_pre_attn_scalar"])
                               if hf.get("query_pre_attn_scalar") else None),
        sliding_window=(int(hf["sliding_window"])
                        if hf.get("sliding_window") and "sliding" in layer_types else None),
        layer_types=layer_types,
        tie_embeddings=bool(hf.get("tie_word_embeddings",
                                   switches.get("tie_embeddings", False))),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=hf.get("pad_token_id"),
    )


def _rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": rope.kind, "rope_theta": rope.theta}
    if rope.kind in ("linear", "llama3"):
        out["factor"] = rope.factor
    if rope.kind == "llama3":
        out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                   original_max_position_embeddings=rope.original_max_position_embeddings)
    return out


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A config.json dict in the transformers 5 layout, with the 4.x RoPE keys alongside."""
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": HF_MODEL_TYPE[cfg.family],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": (list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1
                         else cfg.eos_token_ids[0]),
        "pad_token_id": cfg.pad_token_id,
        "dtype": "float32",
    }
    act = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[cfg.activation]
    hf["hidden_act"] = act
    if cfg.family in ("gemma2", "gemma3"):
        hf["hidden_activation"] = act
    if cfg.family in ("llama", "qwen3", "gemma", "gemma2", "gemma3"):
        hf["attention_bias"] = False
    if cfg.family == "llama":
        hf["mlp_bias"] = False
    if cfg.family in ("gemma2", "gemma3"):
        qpas = cfg.query_pre_attn_scalar
        hf.update(query_pre_attn_scalar=int(qpas) if qpas and float(qpas).is_integer() else qpas,
                  attn_logit_softcapping=cfg.attn_softcap,
                  final_logit_softcapping=cfg.final_softcap)
    if cfg.sliding_window:
        hf["sliding_window"] = cfg.sliding_window
    hf["layer_types"] = [{"full": "full_attention", "sliding": "sliding_attention"}[t]
                         for t in cfg.layer_types]
    if cfg.family == "gemma3":
        local = cfg.local_rope or RopeConfig()
        hf["rope_parameters"] = {"full_attention": _rope_to_hf(cfg.rope),
                                 "sliding_attention": _rope_to_hf(local)}
        hf["rope_theta"] = cfg.rope.theta
        hf["rope_local_base_freq"] = local.theta
    else:
        hf["rope_parameters"] = _rope_to_hf(cfg.rope)
        hf["rope_theta"] = cfg.rope.theta
    if cfg.rope.kind != "default":
        hf["rope_scaling"] = _rope_to_hf(cfg.rope)
    return hf
