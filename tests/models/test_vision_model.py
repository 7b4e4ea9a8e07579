"""Gemma 3 vision-language parity with transformers, checkpoint round trip, merge and mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from nonstop.models import ConfigError, ModelConfig, load_pretrained, save_pretrained
from nonstop.models.lora import LoRAConfig, apply_lora, merge_lora
from nonstop.models.multimodal import Gemma3VLM, VLMConfig, image_lookahead
from nonstop.models.vision import VisionConfig, apply_vision_lora, merge_vision_lora
from nonstop.models.vlm_checkpoint import canonical_name
from tests.models.vlm_fixtures import build_hf_vlm, hf_vlm_logits, image_prompt

ATOL_HF = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3_vlm")
    hf = build_hf_vlm(directory, seed=3)
    return hf, load_pretrained(directory)


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randn(n, 28, 28, 3).astype(np.float32)


def test_loads_as_vision_language_model(models):
    _, ours = models
    assert isinstance(ours, Gemma3VLM)
    assert ours.vlm_cfg.mm_tokens_per_image == 4 and ours.vlm_cfg.vision.patches_per_side == 4


def test_logits_match_transformers_two_images(models):
    """Two images; text before, between and after; the sliding window (4) is shorter than an
    image block with its markers, so window and bidirectional mask both matter."""
    hf, ours = models
    tokens = np.array([image_prompt([1, 17, 23], 1, [29]) + image_prompt([], 1, [31, 41, 5, 7])],
                      np.int32)
    images = _images(2)
    ref = hf_vlm_logits(hf, tokens, images)
    logits, _ = ours(jnp.asarray(tokens), images=jnp.asarray(images))
    np.testing.assert_allclose(np.asarray(logits), ref, atol=ATOL_HF, rtol=0)


def test_batch_of_rows_matches_transformers(models):
    """Images are taken row-major across the batch, as transformers' masked_scatter does."""
    hf, ours = models
    tokens = np.array([image_prompt([1, 3], 1, [7, 11, 13]), image_prompt([1], 1, [19, 23, 5, 9])],
                      np.int32)
    images = _images(2, seed=1)
    ref = hf_vlm_logits(hf, tokens, images)
    logits, _ = ours(jnp.asarray(tokens), images=jnp.asarray(images))
    np.testing.assert_allclose(np.asarray(logits), ref, atol=ATOL_HF, rtol=0)


def test_text_only_prompt_matches_transformers(models):
    hf, ours = models
    tokens = np.array([[1, 5, 9, 13, 17, 21, 25]], np.int64)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens)).logits.numpy()
    logits, _ = ours(jnp.asarray(tokens, jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), ref, atol=ATOL_HF, rtol=0)


def test_save_round_trip_loads_in_transformers(models, tmp_path):
    hf, ours = models
    save_pretrained(ours, tmp_path)
    reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32).eval()
    tokens = np.array([image_prompt([1, 9], 1, [4, 6])], np.int32)
    images = _images(1, seed=2)
    np.testing.assert_allclose(hf_vlm_logits(reloaded, tokens, images),
                               hf_vlm_logits(hf, tokens, images), atol=1e-6, rtol=0)
    again = load_pretrained(tmp_path)
    t, im = jnp.asarray(tokens), jnp.asarray(images)
    np.testing.assert_array_equal(np.asarray(again(t, images=im)[0]),
                                  np.asarray(ours(t, images=im)[0]))


def test_placeholder_count_mismatch_is_an_error(models):
    _, ours = models
    tokens = jnp.asarray([image_prompt([1], 1, [4])], jnp.int32)
    with pytest.raises(ValueError, match=r"8 image placeholder|4 image placeholder"):
        ours(tokens, images=jnp.asarray(_images(2)))


def test_image_lookahead_by_hand():
    is_image = jnp.asarray([[0, 1, 1, 1, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(np.asarray(image_lookahead(is_image)),
                                  [[0, 2, 1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0, 1, 0]])


def test_released_checkpoint_names_are_accepted():
    assert canonical_name("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight") == (
        "vision_tower.encoder.layers.0.mlp.fc1.weight")
    assert canonical_name("model.language_model.layers.3.mlp.up_proj.weight") == (
        "language_model.model.layers.3.mlp.up_proj.weight")
    assert canonical_name("multi_modal_projector.mm_soft_emb_norm.weight") == (
        "multi_modal_projector.mm_soft_emb_norm.weight")


def test_released_config_fields_default_as_transformers():
    """A config.json laid out like google/gemma-3-4b-it's (defaults left out) reads the same
    as the full dict transformers expands it to."""
    sparse = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
        "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16,
                          "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
    }
    ours = VLMConfig.from_hf(sparse)
    full = transformers.Gemma3Config(**{k: v for k, v in sparse.items()
                                        if k not in ("architectures", "model_type")}).to_dict()
    reference = VLMConfig.from_hf(full)
    assert ours.vision == reference.vision
    assert ours.text.replace(eos_token_ids=()) == reference.text.replace(eos_token_ids=())
    assert ours.text.eos_token_ids == (1, 106)
    assert (ours.text.vocab_size, ours.text.head_dim, ours.text.rope.theta,
            ours.text.rope.factor) == (262208, 256, 1e6, 8.0)
    assert ours.vision.patches_per_side == 64 and ours.mm_tokens_per_image == 256


def test_vision_and_vlm_config_values_are_named():
    vision = dict(hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, image_size=28,
                  patch_size=14)
    with pytest.raises(ConfigError, match=r"^VisionConfig\.image_size=30 is invalid; "
                                          r"expected a multiple of patch_size=14$"):
        VisionConfig(**{**vision, "image_size": 30})
    with pytest.raises(ConfigError, match=r"^VisionConfig\.hidden_size=9 is invalid; "
                                          r"expected a multiple of num_heads=2$"):
        VisionConfig(**{**vision, "hidden_size": 9})
    with pytest.raises(ConfigError, match=r"^VisionConfig\.num_layers=0 is invalid; "
                                          r"expected an int >= 1$"):
        VisionConfig(**{**vision, "num_layers": 0})
    glue = dict(vision=VisionConfig(**vision), image_token_id=5, boi_token_id=6, eoi_token_id=7)
    with pytest.raises(ConfigError, match=r"^VLMConfig\.mm_tokens_per_image=0 is invalid; "
                                          r"expected an int >= 1$"):
        VLMConfig(text=ModelConfig.tiny("gemma3"), mm_tokens_per_image=0, **glue)
    with pytest.raises(ConfigError, match=r"^VLMConfig\.text\.family='llama' is invalid; "
                                          r"expected 'gemma3'"):
        VLMConfig(text=ModelConfig.tiny("llama"), mm_tokens_per_image=4, **glue)


def test_vlm_config_json_without_text_config_names_the_key():
    hf = {"model_type": "gemma3", "vision_config": {}}
    with pytest.raises(ConfigError, match=r"<dict>: required config field 'text_config' is "
                                          r"missing"):
        VLMConfig.from_hf(hf)


def test_lora_on_both_towers_merges_and_exports(models, tmp_path):
    """Adapters on the language model and the vision tower change the logits; merged and saved,
    transformers reproduces the adapted model's logits."""
    hf, _ = models
    directory = tmp_path / "base"
    hf.save_pretrained(directory)
    model = load_pretrained(directory)
    apply_lora(model, LoRAConfig(rank=3, alpha=6.0))
    apply_vision_lora(model.vision, LoRAConfig(rank=3, alpha=6.0, targets=("q_proj", "o_proj")))
    keys = iter(jax.random.split(jax.random.key(7), 64))
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        var.set_value(0.1 * jax.random.normal(next(keys), var.get_value().shape))
    tokens = np.array([image_prompt([1, 9], 1, [4, 6])], np.int32)
    images = _images(1, seed=4)
    t, im = jnp.asarray(tokens), jnp.asarray(images)
    adapted = np.asarray(model(t, images=im)[0])
    assert np.abs(adapted - hf_vlm_logits(hf, tokens, images)).max() > 1e-2
    merge_lora(model)
    merge_vision_lora(model.vision)
    save_pretrained(model, tmp_path / "merged")
    reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        tmp_path / "merged", dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_vlm_logits(reloaded, tokens, images), adapted, atol=ATOL_HF,
                               rtol=0)
