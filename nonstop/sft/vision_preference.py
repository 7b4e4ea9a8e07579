"""DPO on image + text preference data for Gemma 3 vision-language models.

A record is {"prompt": ..., "chosen": ..., "rejected": ..., "images": [...]} (image markers in
the prompt as in `vision_data.py`). It becomes one row: prompt + chosen as segment 1, then
prompt + rejected as segment 2, each segment with its own copy of the images (attention never
crosses segments), so `preference_pairs` of `nonstop.sft.losses` reads the pair as for text.

`vision_dpo_loss_fn(config)` is the `make_train_step` loss. Its reference policy is the policy
with every LoRA adapter zeroed (`zeroed_adapters`), or none when `config.reference_free`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nonstop.models.image_processor import ImageProcessor
from nonstop.models.multimodal import VLMConfig
from nonstop.sft.losses import DPOConfig, dpo_loss, preference_pairs, sequence_logprobs
from nonstop.sft.preference import zeroed_adapters
from nonstop.sft.vision_data import (
    TextEncoder,
    VisionBatch,
    VisionDataError,
    VisionExample,
    jsonl_records,
    prompt_with_images,
)
from nonstop.train.logprobs import token_logprobs
from nonstop.train.step import LossFn


def read_vision_preference(path: str | Path, tokenizer: TextEncoder, processor: ImageProcessor,
                           cfg: VLMConfig) -> list[VisionExample]:
    """Every preference pair of a JSONL file as a two-segment example."""
    path = Path(path)
    out = []
    for where, record in jsonl_records(path):
        for key in ("prompt", "chosen", "rejected"):
            if not isinstance(record.get(key), str):
                raise VisionDataError(f"{where}: field {key!r} must be a string; the record has "
                                      f"fields {sorted(record)}")
        prompt, images = prompt_with_images(where, record["prompt"], record.get("images", []),
                                            path.parent, tokenizer, processor, cfg)
        tokens, mask, segments = [], [], []
        for seg, key in ((1, "chosen"), (2, "rejected")):
            response = tokenizer.encode(record[key])
            tokens += prompt + response
            mask += [False] * len(prompt) + [True] * len(response)
            segments += [seg] * (len(prompt) + len(response))
        out.append(VisionExample(tokens=np.asarray(tokens, np.int32),
                                 loss_mask=np.asarray(mask, bool),
                                 images=np.concatenate([images, images]),
                                 segment_ids=np.asarray(segments, np.int32)))
    return out


def _pair_logprobs(model: nnx.Module, batch: VisionBatch):
    logits, _ = model(batch.tokens, batch.positions, batch.segment_ids,
                      images=jnp.asarray(batch.images))
    seqs = sequence_logprobs(token_logprobs(logits, batch.tokens), batch.loss_mask,
                             batch.segment_ids, 2)
    return preference_pairs(seqs)


def vision_dpo_loss_fn(config: DPOConfig) -> LossFn:
    """Summed DPO pair losses / number of pairs, with DPO metrics as aux."""

    def loss_fn(model: nnx.Module, batch: VisionBatch, rng: jax.Array):
        del rng
        policy = _pair_logprobs(model, batch)
        reference = None
        if not config.reference_free:
            reference = jax.tree.map(jax.lax.stop_gradient,
                                     _pair_logprobs(zeroed_adapters(model), batch))
        loss, metrics = dpo_loss(policy, reference, config)
        return loss.total, loss.count, metrics._asdict()

    return loss_fn


__all__ = ["read_vision_preference", "vision_dpo_loss_fn"]
