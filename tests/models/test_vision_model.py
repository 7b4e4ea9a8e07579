"""Gemma 3 vision-language parity with transformers, checkpoint round trip, merge and mask."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from nonstop.models import load_pretrained, save_pretrained
from nonstop.models.multimodal import Gemma3VLM, image_lookahead
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
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray(tokens), jnp.asarray(images))[0]),
                                  np.asarray(ours(jnp.asarray(tokens), images=jnp.asarray(images))[0]))


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
