"""Tiny random Hugging Face checkpoints for every family, built locally with transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

FAMILIES = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")

_COMMON = dict(vocab_size=257, hidden_size=44, intermediate_size=53, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=512, rms_norm_eps=1e-6,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hf_config(family: str, num_layers: int = 3) -> transformers.PretrainedConfig:
    """A tiny transformers config exercising each family's distinctive switches."""
    c = dict(_COMMON, num_hidden_layers=num_layers)
    if family == "llama":
        return transformers.LlamaConfig(**c, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if family == "qwen2":
        return transformers.Qwen2Config(**c, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1e6})
    if family == "qwen3":
        return transformers.Qwen3Config(**c, tie_word_embeddings=False)
    if family == "gemma":
        return transformers.GemmaConfig(**c, hidden_act="gelu_pytorch_tanh")
    if family == "gemma2":
        return transformers.Gemma2Config(**c, query_pre_attn_scalar=11, sliding_window=4,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **dict(c, num_hidden_layers=max(num_layers, 7)), query_pre_attn_scalar=11,
            sliding_window=4, rope_parameters={
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    raise ValueError(family)


def build_hf_model(family: str, directory: Path, *, seed: int = 0,
                   num_layers: int = 3) -> transformers.PreTrainedModel:
    """A randomly initialised model whose every parameter (norms and biases too) is random."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, num_layers),
                                                          dtype=torch.float32)
    return randomize_and_save(model, directory, seed=seed)


def randomize_and_save(model: transformers.PreTrainedModel, directory: Path, *,
                       seed: int = 0) -> transformers.PreTrainedModel:
    """Every parameter random (vectors around 0.5, so norms are not near 0), then saved."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (0.5 if p.ndim == 1 else 0.0))
    model.eval()
    model.save_pretrained(directory)
    return model


def hf_logits(model: transformers.PreTrainedModel, tokens: np.ndarray,
              attention_mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor(tokens), attention_mask=None if attention_mask is None
                    else torch.tensor(attention_mask))
    return out.logits.float().numpy()
