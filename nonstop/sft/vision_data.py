"""Image + text supervised data for Gemma 3 vision-language SFT: JSONL with local image paths.

A record is {"prompt": ..., "completion": ..., "images": ["a.png", ...]}; each `<start_of_image>`
in the prompt is where one image goes, in order (Gemma 3's chat template writes that marker for
an image content part). Or it is {"messages": [...]} whose content lists may hold
{"type": "image", "path": ...} blocks, rendered with the chat template (the last message is the
assistant's answer). Rendering expands each marker to "\n\n" <boi> + M image placeholders +
<eoi> "\n\n", as transformers' Gemma 3 processor does, so the marker need not be a token of the
tokenizer. Only completion tokens are targets. Images are loaded and processed on the host by
`ImageProcessor`.

Bad input is a `VisionDataError` naming the file and line: a missing field, a missing or
unreadable image, an unsupported image mode, or a marker count that differs from the images.

A `VisionBatch` is a fixed-shape batch (one example per row, right-padded to `seq_len`, images
padded with zero images to `max_images`), so the jitted step compiles once;
`vision_sft_loss` is the `make_train_step` loss for it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nonstop.models.chat import ChatTemplate
from nonstop.models.image_processor import ImageError, ImageProcessor
from nonstop.models.multimodal import VLMConfig
from nonstop.sft.losses import masked_cross_entropy

IMAGE_MARKER = "<start_of_image>"


class VisionDataError(ValueError):
    """An image+text example is malformed; the message names its file and line."""


class TextEncoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class VisionExample:
    """tokens int32[T], loss_mask bool[T] (True on targets), images float32[I, H, W, 3].

    `segment_ids` int32[T] (default all 1): a preference example is prompt + chosen (segment 1)
    then prompt + rejected (segment 2), each with its own copy of the images."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    images: np.ndarray
    segment_ids: np.ndarray | None = None


class VisionBatch(NamedTuple):
    tokens: jax.Array | np.ndarray  # int32[B, T]
    positions: jax.Array | np.ndarray  # int32[B, T]
    segment_ids: jax.Array | np.ndarray  # int32[B, T], 0 = padding
    loss_mask: jax.Array | np.ndarray  # bool[B, T]
    images: jax.Array | np.ndarray  # float32[max_images, H, W, 3]


def encode_with_images(text: str, tokenizer: TextEncoder, cfg: VLMConfig) -> tuple[list[int], int]:
    """Token ids of `text` with each image marker expanded, and the number of markers.

    As transformers' Gemma 3 processor does, a marker becomes "\n\n" <boi> M x <image> <eoi>
    "\n\n"; the text between two images (newlines included) is tokenized as one piece.
    """
    pieces = text.split(IMAGE_MARKER)
    image = [cfg.boi_token_id, *[cfg.image_token_id] * cfg.mm_tokens_per_image, cfg.eoi_token_id]
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i:
            ids.extend(image)
        segment = ("\n\n" if i else "") + piece + ("\n\n" if i < len(pieces) - 1 else "")
        if segment:
            ids.extend(tokenizer.encode(segment))
    return ids, len(pieces) - 1


def render_image_messages(messages: list[dict[str, Any]], template: ChatTemplate
                          ) -> tuple[str, str, list[str]]:
    """Chat messages whose content may hold {"type": "image", "path": ...} blocks ->
    (prompt text with image markers, final assistant text, image paths in order).

    Image blocks are rendered as the `<start_of_image>` marker, as Gemma 3's chat template does;
    the last message must be the assistant's answer (the target)."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("the last message must be the assistant's answer")
    paths: list[str] = []
    plain = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            blocks = []
            for block in content:
                if isinstance(block, dict) and block.get("type") == "image":
                    path = block.get("path") or block.get("image")
                    if not isinstance(path, str):
                        raise ValueError("an image block needs a 'path' (a local file)")
                    paths.append(path)
                    blocks.append({"type": "text", "text": IMAGE_MARKER})
                else:
                    blocks.append(block)
            m = {**m, "content": blocks}
        plain.append(m)
    prompt = template.render(plain[:-1], add_generation_prompt=True)
    full = template.render(plain)
    if not full.startswith(prompt):
        raise ValueError("the chat template does not render the prompt as a prefix of the "
                         "conversation")
    return prompt, full[len(prompt):], paths


def prompt_with_images(where: str, prompt_text: str, image_paths: Any, base_dir: Path,
                       tokenizer: TextEncoder, processor: ImageProcessor, cfg: VLMConfig
                       ) -> tuple[list[int], np.ndarray]:
    """The prompt's token ids (image markers expanded) and its processed images, checking that
    there is one image path (relative to `base_dir`) per marker."""
    if not isinstance(image_paths, list):
        raise VisionDataError(f"{where}: field 'images' must be a list of file paths")
    prompt, n_markers = encode_with_images(prompt_text, tokenizer, cfg)
    if n_markers != len(image_paths):
        raise VisionDataError(f"{where}: the prompt has {n_markers} {IMAGE_MARKER} "
                              f"placeholder(s) but {len(image_paths)} image(s) are given; "
                              "put one marker where each image goes")
    try:
        images = processor.batch([base_dir / p for p in image_paths], where=where)
    except ImageError as e:
        raise VisionDataError(str(e)) from None
    return prompt, images


def jsonl_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """("file:line", record) for each non-blank line of a JSONL file of JSON objects."""
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise VisionDataError(f"{where}: not valid JSON: {e}") from None
        if not isinstance(record, dict):
            raise VisionDataError(f"{where}: a record must be a JSON object, got "
                                  f"{type(record).__name__}")
        yield where, record


def read_vision_sft(path: str | Path, tokenizer: TextEncoder, processor: ImageProcessor,
                    cfg: VLMConfig, *, template: ChatTemplate | None = None
                    ) -> list[VisionExample]:
    """Every example of a JSONL file; image paths are relative to the file's directory.

    Records are {"prompt", "completion", "images"} or {"messages"} (rendered with `template`,
    image content blocks {"type": "image", "path": ...})."""
    path = Path(path)
    out = []
    for where, record in jsonl_records(path):
        if isinstance(record.get("messages"), list):
            if template is None:
                raise VisionDataError(f"{where}: a 'messages' record needs a chat template")
            try:
                prompt_text, completion_text, image_paths = render_image_messages(
                    record["messages"], template)
            except ValueError as e:
                raise VisionDataError(f"{where}: {e}") from None
        else:
            for key in ("prompt", "completion"):
                if not isinstance(record.get(key), str):
                    raise VisionDataError(f"{where}: field {key!r} must be a string (or give "
                                          f"'messages'); the record has fields {sorted(record)}")
            prompt_text, completion_text = record["prompt"], record["completion"]
            image_paths = record.get("images", [])
        prompt, images = prompt_with_images(where, prompt_text, image_paths, path.parent,
                                             tokenizer, processor, cfg)
        completion = tokenizer.encode(completion_text)
        tokens = np.asarray(prompt + completion, np.int32)
        loss_mask = np.zeros(len(tokens), bool)
        loss_mask[len(prompt):] = True
        out.append(VisionExample(tokens=tokens, loss_mask=loss_mask, images=images))
    return out


def make_vision_batch(examples: Sequence[VisionExample], *, seq_len: int, max_images: int,
                      pad_id: int = 0) -> VisionBatch:
    """One example per row, right-padded; images concatenated in row order, zero-padded."""
    B = len(examples)
    tokens = np.full((B, seq_len), pad_id, np.int32)
    segment_ids = np.zeros((B, seq_len), np.int32)
    loss_mask = np.zeros((B, seq_len), bool)
    images = [ex.images for ex in examples if len(ex.images)]
    n_images = sum(len(im) for im in images)
    if n_images > max_images:
        raise VisionDataError(f"the batch has {n_images} images, more than max_images="
                              f"{max_images}; raise it or make batches smaller")
    for row, ex in enumerate(examples):
        if len(ex.tokens) > seq_len:
            raise VisionDataError(f"an example has {len(ex.tokens)} tokens, more than seq_len="
                                  f"{seq_len} (image tokens count too); raise seq_len")
        n = len(ex.tokens)
        tokens[row, :n] = ex.tokens
        segment_ids[row, :n] = 1 if ex.segment_ids is None else ex.segment_ids
        loss_mask[row, :n] = ex.loss_mask
    shape = examples[0].images.shape[1:] if n_images else images_shape_of(examples)
    pixels = np.zeros((max_images, *shape), np.float32)
    if n_images:
        pixels[:n_images] = np.concatenate(images)
    positions = np.zeros((B, seq_len), np.int32)
    for row in range(B):  # positions restart with each segment
        for seg in np.unique(segment_ids[row][segment_ids[row] > 0]):
            where = np.flatnonzero(segment_ids[row] == seg)
            positions[row, where] = np.arange(len(where))
    return VisionBatch(tokens, positions, segment_ids, loss_mask, pixels)


def images_shape_of(examples: Sequence[VisionExample]) -> tuple[int, ...]:
    for ex in examples:
        if ex.images.ndim == 4:
            return tuple(ex.images.shape[1:])
    raise VisionDataError("cannot tell the image size: no example in the batch has images")


def vision_sft_loss(model: nnx.Module, batch: VisionBatch, rng: jax.Array
                    ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Summed completion NLL and target count (the `make_train_step` loss contract)."""
    del rng
    logits, _ = model(batch.tokens, batch.positions, batch.segment_ids,
                      images=jnp.asarray(batch.images))
    out = masked_cross_entropy(logits, batch.tokens, batch.loss_mask, batch.segment_ids)
    return out.total, out.count, {}


__all__ = ["IMAGE_MARKER", "VisionBatch", "VisionDataError", "VisionExample",
           "encode_with_images", "make_vision_batch", "read_vision_sft",
           "render_image_messages", "vision_sft_loss"]
