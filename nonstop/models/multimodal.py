"""Gemma 3 vision-language model: SigLIP tower + projector + the text decoder, merged at tokens.

A prompt holds `mm_tokens_per_image` image placeholder tokens per image (the chat template
wraps them in begin/end-of-image tokens). The k-th placeholder of the batch, counted row-major,
receives the k-th soft token of the images in order (as transformers' `masked_scatter` does);
the other tokens are embedded as text (scaled by sqrt(D) for Gemma, image features are not).

In the language model, each contiguous run of image tokens attends to itself bidirectionally on
top of the causal mask (transformers' `token_type_ids` mask): a query in a run may also see the
rest of its run. This is passed to the decoder as a per-token `lookahead`. In sliding-window
layers the window still applies (keys more than `window - 1` behind are hidden).

    logits, _ = vlm(tokens, images=images)              # images float32[I, H, W, C]
    feats = vlm.encode_images(images)                   # [I, M, D], e.g. once per request
    logits, cache = vlm(tokens, positions, image_features=feats, cache=cache, slots=...)

Called without images it is the text decoder (same signature as `Decoder`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array

from nonstop.models.config import ConfigError, ModelConfig
from nonstop.models.decoder import Decoder, KVCache
from nonstop.models.hf_config import _METADATA, _need, config_from_hf
from nonstop.models.validation import check
from nonstop.models.vision import MultiModalProjector, VisionConfig, VisionEncoder

# Top-level Gemma3Config keys that carry no architecture we would drop.
_VLM_METADATA = {
    "architectures", "model_type", "text_config", "vision_config", "mm_tokens_per_image",
    "image_token_index", "boi_token_index", "eoi_token_index", "initializer_range",
    "tie_word_embeddings", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
    "eos_token_id", "bos_token_id", "pad_token_id", "use_cache",
}

# transformers' Gemma3TextConfig defaults: released configs leave these fields out.
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_local_base_freq": 10_000.0, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class VLMConfig:
    """A Gemma 3 vision-language model: text decoder, vision tower and the glue between them."""

    text: ModelConfig
    vision: VisionConfig
    mm_tokens_per_image: int  # M soft tokens per image
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    def __post_init__(self) -> None:
        check(self.text.family == "gemma3", "VLMConfig", "text.family", self.text.family,
              "'gemma3' (the vision-language model is Gemma 3's)")
        check(self.mm_tokens_per_image > 0, "VLMConfig", "mm_tokens_per_image",
              self.mm_tokens_per_image, "an int >= 1")

    @classmethod
    def from_hf(cls, config: str | Path | dict[str, Any]) -> VLMConfig:
        """Read a `Gemma3ForConditionalGeneration` config.json (path, directory or dict)."""
        source = "<dict>"
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            if not path.exists():
                raise ConfigError(f"{path}: no config.json found")
            source, config = str(path), json.loads(path.read_text())
        if config.get("model_type") != "gemma3" or "vision_config" not in config:
            raise ConfigError(f"{source}: not a Gemma 3 vision-language config (model_type "
                              f"{config.get('model_type')!r}, vision_config "
                              f"{'present' if 'vision_config' in config else 'missing'})")
        for key in config:
            if key not in _VLM_METADATA and key not in _METADATA and not key.startswith("_"):
                raise ConfigError(f"{source}: config field {key!r} = {config[key]!r} is not "
                                  "supported by nonstop's Gemma 3 vision-language model")
        text_hf = {**_TEXT_DEFAULTS, **_need(config, "text_config", source),
                   "model_type": "gemma3_text"}
        if "rope_theta" not in text_hf and "rope_parameters" not in text_hf:
            text_hf["rope_theta"] = 1_000_000.0  # Gemma 3's global RoPE base
        if "tie_word_embeddings" in config:
            text_hf["tie_word_embeddings"] = config["tie_word_embeddings"]
        if config.get("eos_token_id") is not None:
            text_hf["eos_token_id"] = config["eos_token_id"]
        text = config_from_hf(text_hf, source=f"{source} (text_config)")
        vision = VisionConfig.from_hf(config["vision_config"], source=source)
        return cls(text=text, vision=vision,
                   mm_tokens_per_image=int(config.get("mm_tokens_per_image", 256)),
                   image_token_id=int(config.get("image_token_index", 262144)),
                   boi_token_id=int(config.get("boi_token_index", 255999)),
                   eoi_token_id=int(config.get("eoi_token_index", 256000)))

    def to_hf(self) -> dict[str, Any]:
        text = self.text.to_hf()
        text.pop("architectures", None)
        return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                "text_config": text, "vision_config": self.vision.to_hf(),
                "mm_tokens_per_image": self.mm_tokens_per_image,
                "image_token_index": self.image_token_id, "boi_token_index": self.boi_token_id,
                "eoi_token_index": self.eoi_token_id,
                "tie_word_embeddings": self.text.tie_embeddings, "dtype": "float32"}


def image_lookahead(is_image: Array) -> Array:
    """int32[B, T]: for an image token, how many image tokens follow it in its run; else 0."""
    B, T = is_image.shape
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    first_text_from = jax.lax.cummin(jnp.where(is_image, T, idx), axis=1, reverse=True)
    return jnp.where(is_image, first_text_from - 1 - idx, 0).astype(jnp.int32)


def merge_image_features(x: Array, is_image: Array, features: Array) -> Array:
    """x [B, T, D] with the image positions (row-major) replaced by features [N, D] in order."""
    order = jnp.cumsum(is_image.reshape(-1).astype(jnp.int32)) - 1
    gathered = jnp.take(features.astype(x.dtype), jnp.clip(order, 0, features.shape[0] - 1),
                        axis=0).reshape(x.shape)
    return jnp.where(is_image[..., None], gathered, x)


def check_image_tokens(tokens: np.ndarray, num_images: int, cfg: VLMConfig,
                       where: str = "input") -> None:
    """Raise ValueError unless `tokens` hold exactly M placeholders for each of `num_images`."""
    found = int(np.sum(np.asarray(tokens) == cfg.image_token_id))
    need = num_images * cfg.mm_tokens_per_image
    if found != need:
        raise ValueError(f"{where}: {found} image placeholder tokens (id {cfg.image_token_id}) "
                         f"but {num_images} image(s) x {cfg.mm_tokens_per_image} tokens = {need}; "
                         "render images with the chat template so each image gets its tokens")


class Gemma3VLM(nnx.Module):
    """Vision tower, projector and language model.

    `vlm_cfg` is the `VLMConfig`; `cfg` is the language model's `ModelConfig`, and
    `embed_tokens`, `hidden_states`, `logits` and `layers` are the language model's, so code
    written for a `Decoder` (the engine's text steps, LoRA on the language model, the trainers'
    text batches) runs on the vision-language model unchanged.
    """

    def __init__(self, cfg: VLMConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32,
                 param_dtype: jnp.dtype = jnp.float32):
        self.vlm_cfg = cfg
        self.cfg = cfg.text
        self.dtype = dtype
        self.vision = VisionEncoder(cfg.vision, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.projector = MultiModalProjector(cfg.vision, text_hidden_size=cfg.text.hidden_size,
                                             tokens_per_image=cfg.mm_tokens_per_image,
                                             rngs=rngs, param_dtype=param_dtype)
        self.language_model = Decoder(cfg.text, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def encode_images(self, images: Array) -> Array:
        """images float32[I, H, W, C] (processed) -> soft tokens [I, M, D]."""
        return self.projector(self.vision(images)).astype(self.dtype)

    def embed(self, tokens: Array, image_features: Array | None) -> tuple[Array, Array | None]:
        """Token embeddings with image features merged in, and the image lookahead (or None)."""
        lm = self.language_model
        if image_features is None:
            return lm.embed_tokens(tokens), None
        is_image = tokens == self.vlm_cfg.image_token_id
        # The placeholder id may lie outside the vocabulary; its embedding is replaced anyway.
        x = lm.embed_tokens(jnp.where(is_image, 0, tokens))
        flat = image_features.reshape(-1, image_features.shape[-1])
        return merge_image_features(x, is_image, flat), image_lookahead(is_image)

    @property
    def layers(self) -> nnx.List:
        return self.language_model.layers

    def embed_tokens(self, tokens: Array) -> Array:
        return self.language_model.embed_tokens(tokens)

    def hidden_states(self, x: Array, positions: Array, segment_ids: Array,
                      cache: KVCache | None, slots: Array | None,
                      lookahead: Array | None = None, attend_len: int | None = None
                      ) -> tuple[Array, KVCache | None]:
        return self.language_model.hidden_states(x, positions, segment_ids, cache, slots,
                                                 lookahead, attend_len)

    def logits(self, h: Array) -> Array:
        return self.language_model.logits(h)

    def __call__(self, tokens: Array, positions: Array | None = None,
                 segment_ids: Array | None = None, *, images: Array | None = None,
                 image_features: Array | None = None, cache: KVCache | None = None,
                 slots: Array | None = None) -> tuple[Array, KVCache | None]:
        """tokens int32[B, T] (+ images or their features) -> (float32 logits [B, T, V], cache)."""
        B, T = tokens.shape
        if images is not None:
            if image_features is not None:
                raise ValueError("pass images or image_features, not both")
            image_features = self.encode_images(images)
        if image_features is not None and not isinstance(tokens, jax.core.Tracer):
            check_image_tokens(np.asarray(tokens), image_features.shape[0], self.vlm_cfg)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if segment_ids is None:
            segment_ids = jnp.ones((B, T), jnp.int32)
        x, lookahead = self.embed(tokens, image_features)
        h, cache = self.language_model.hidden_states(x, positions, segment_ids, cache, slots,
                                                     lookahead)
        return self.language_model.logits(h), cache


def init_vlm(cfg: VLMConfig, *, seed: int = 0, dtype: jnp.dtype = jnp.float32,
             param_dtype: jnp.dtype = jnp.float32) -> Gemma3VLM:
    """A randomly initialised vision-language model."""
    return Gemma3VLM(cfg, rngs=nnx.Rngs(params=seed), dtype=dtype, param_dtype=param_dtype)


def abstract_vlm(cfg: VLMConfig, *, dtype: jnp.dtype = jnp.float32,
                 param_dtype: jnp.dtype = jnp.float32) -> Gemma3VLM:
    """The model with shape-only parameters, for loading."""
    return nnx.eval_shape(lambda: Gemma3VLM(cfg, rngs=nnx.Rngs(params=0), dtype=dtype,
                                            param_dtype=param_dtype))


def is_vlm_config(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "gemma3" and "vision_config" in config


__all__ = ["Gemma3VLM", "VLMConfig", "abstract_vlm", "check_image_tokens", "image_lookahead",
           "init_vlm", "is_vlm_config", "merge_image_features"]
