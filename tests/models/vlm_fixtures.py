"""A tiny random Gemma 3 vision-language checkpoint built locally with transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

from tests.models.hf_fixtures import randomize_and_save

IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = 250, 251, 252
TOKENS_PER_IMAGE = 4
IMAGE_SIZE = 28


def hf_vlm_config() -> transformers.Gemma3Config:
    """Text: 7 layers (sliding window 4 < an image run + its neighbours); vision: 28px, patch 7."""
    text = transformers.Gemma3TextConfig(
        vocab_size=257, hidden_size=44, intermediate_size=53, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, num_hidden_layers=7,
        query_pre_attn_scalar=11, sliding_window=4, rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    vision = transformers.SiglipVisionConfig(
        hidden_size=22, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=7, layer_norm_eps=1e-6, vision_use_head=False)
    return transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(),
        mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=IMAGE_TOKEN,
        boi_token_index=BOI_TOKEN, eoi_token_index=EOI_TOKEN)


def build_hf_vlm(directory: Path, *, seed: int = 0) -> transformers.PreTrainedModel:
    """A random model whose every parameter (norms and biases too) is random, saved to disk."""
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(hf_vlm_config()).to(torch.float32)
    return randomize_and_save(model, directory, seed=seed)


def image_prompt(text_before: list[int], num_images: int, text_after: list[int]) -> list[int]:
    """Tokens: text, then each image as <boi> M x <image> <eoi>, then more text."""
    image = [BOI_TOKEN, *[IMAGE_TOKEN] * TOKENS_PER_IMAGE, EOI_TOKEN]
    return [*text_before, *image * num_images, *text_after]


def hf_vlm_logits(model: transformers.PreTrainedModel, tokens: np.ndarray,
                  images: np.ndarray) -> np.ndarray:
    """Logits for tokens [B, T] and channels-last images [I, H, W, C]."""
    ids = torch.tensor(tokens, dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=torch.tensor(images).permute(0, 3, 1, 2),
                    token_type_ids=(ids == IMAGE_TOKEN).long())
    return out.logits.float().numpy()
