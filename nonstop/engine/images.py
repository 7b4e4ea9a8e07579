"""Image prompts in the engine: checking them, and cutting their prefill into chunks.

A vision-language prompt carries the soft tokens of its images (encoded once, when the request
is made) as float32[num_image_tokens, D], one row per image placeholder token in order. Image
tokens attend to the whole of their image, so a prefill chunk never ends inside a run of image
tokens (the rest of the run would not be in the cache yet): `image_safe_length` shortens the
chunk to end before the run, and a run longer than the largest prefill chunk is refused when the
request is made. Such requests start from an empty slot: the KV cache of a prefix is not reused,
since equal placeholder tokens may stand for different images.
"""

from __future__ import annotations

import numpy as np


def image_runs(prompt: np.ndarray, image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of image tokens, end exclusive."""
    is_image = np.concatenate([[False], np.asarray(prompt) == image_token_id, [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def check_image_prompt(prompt: list[int], features: np.ndarray, image_token_id: int,
                       max_chunk: int) -> None:
    """Raise ValueError unless every placeholder has a soft token and every run fits a chunk."""
    n_image = sum(1 for t in prompt if t == image_token_id)
    if n_image != features.shape[0]:
        raise ValueError(f"the prompt has {n_image} image placeholder tokens (id "
                         f"{image_token_id}) but the images give {features.shape[0]} soft tokens; "
                         "render each image with the chat template")
    for a, b in image_runs(np.asarray(prompt), image_token_id):
        if b - a > max_chunk:
            raise ValueError(f"an image's {b - a} tokens exceed the largest prefill chunk "
                             f"({max_chunk}); add a larger size to EngineConfig.prefill_chunks")


def image_safe_length(prompt: list[int], start: int, n: int, image_token_id: int) -> int:
    """`n`, or less so that prompt[start:start + n] does not end inside a run of image tokens."""
    end = start + n
    if end >= len(prompt) or prompt[end] != image_token_id or prompt[end - 1] != image_token_id:
        return n
    run_start = end - 1
    while run_start > start and prompt[run_start - 1] == image_token_id:
        run_start -= 1
    return run_start - start if run_start > start else n


def image_chunk(prompt: list[int], features: np.ndarray, start: int, n: int, C: int,
                image_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Soft tokens float32[C, D] for rows of prompt[start:start + n] and lookahead int32[1, C]."""
    chunk = np.asarray(prompt[start:start + n])
    first = sum(1 for t in prompt[:start] if t == image_token_id)
    rows = np.flatnonzero(chunk == image_token_id)
    feats = np.zeros((C, features.shape[1]), np.float32)
    feats[rows] = features[first:first + len(rows)]
    lookahead = np.zeros((1, C), np.int32)
    for a, b in image_runs(chunk, image_token_id):
        lookahead[0, a:b] = np.arange(b - a - 1, -1, -1)
    return feats, lookahead


__all__ = ["check_image_prompt", "image_chunk", "image_runs", "image_safe_length"]
