"""Image prompts in the engine: greedy completions equal a full-forward greedy loop.

A tiny random Gemma 3 vision-language checkpoint (tests/models/vlm_fixtures.py) runs in an
engine whose prefill chunk (8) is shorter than the prompt, placed so that a chunk boundary would
fall inside an image's tokens: the engine must shorten that chunk, since image tokens attend to
their whole image. Tokens must match the reference loop exactly; logprobs within 1e-4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nonstop.engine import Engine, EngineConfig, SamplingParams
from nonstop.engine.types import RequestError
from nonstop.models import load_pretrained
from tests.models.vlm_fixtures import build_hf_vlm, image_prompt

MAX_LEN = 48
ATOL_LOGPROB = 1e-4


@pytest.fixture(scope="module", params=["dense", "paged"])
def vlm_engine(tmp_path_factory, request):
    directory = tmp_path_factory.mktemp("gemma3_vlm_engine")
    build_hf_vlm(directory, seed=5)
    model = load_pretrained(directory)
    engine = Engine(model, EngineConfig(max_slots=2, max_len=MAX_LEN, prefill_chunks=(8,),
                                        kv_layout=request.param, block_size=5))
    with engine:
        yield model, engine


def _images(n: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randn(n, 28, 28, 3).astype(np.float32)


def _reference(model, prompt, images, n):
    """Greedy loop over full forward passes; returns (tokens, logprobs of those tokens)."""
    @jax.jit
    def log_probs(tokens, images):
        return jax.nn.log_softmax(model(tokens, images=images)[0][0], axis=-1)

    seq, lps = list(prompt), []
    buf = np.zeros((1, MAX_LEN), np.int32)
    for _ in range(n):
        buf[0, :len(seq)] = seq
        row = np.asarray(log_probs(jnp.asarray(buf), jnp.asarray(images)))[len(seq) - 1]
        seq.append(int(np.argmax(row)))
        lps.append(float(row[seq[-1]]))
    return seq[len(prompt):], lps


@pytest.mark.parametrize("before,num_images,after", [([1, 7, 11, 13, 17], 2, [19, 23]),
                                                     ([1, 5], 1, [9, 3, 27, 31, 37, 41, 43, 47])])
def test_image_prompt_greedy_equals_full_forward_loop(vlm_engine, before, num_images, after):
    model, engine = vlm_engine
    prompt = image_prompt(before, num_images, after)
    images = _images(num_images, seed=len(prompt))
    done = engine.generate_sync(prompt, SamplingParams(temperature=0.0, max_tokens=6),
                                images=images)
    ref_tokens, ref_logprobs = _reference(model, prompt, images, 6)
    assert list(done.tokens) == ref_tokens
    np.testing.assert_allclose(done.logprobs, ref_logprobs, atol=ATOL_LOGPROB, rtol=0)


def test_images_change_the_completion_context(vlm_engine):
    """The same placeholders with other images give other logprobs: features are not reused."""
    _, engine = vlm_engine
    prompt = image_prompt([1, 5], 1, [9])
    params = SamplingParams(temperature=0.0, max_tokens=2)
    a = engine.generate_sync(prompt, params, images=_images(1, seed=1))
    b = engine.generate_sync(prompt, params, images=_images(1, seed=2))
    assert abs(a.logprobs[0] - b.logprobs[0]) > 1e-6 or a.tokens[0] != b.tokens[0]


def test_placeholder_count_mismatch_is_a_request_error(vlm_engine):
    _, engine = vlm_engine
    with pytest.raises(RequestError, match="4 image placeholder tokens.*8 soft tokens"):
        engine.generate_sync(image_prompt([1], 1, [5]), SamplingParams(max_tokens=1),
                             images=_images(2, seed=0))
    with pytest.raises(RequestError, match=r"images: .*\[I, 28, 28, 3\]"):
        engine.generate_sync(image_prompt([1], 1, [5]), SamplingParams(max_tokens=1),
                             images=np.zeros((1, 14, 14, 3), np.float32))


def test_image_longer_than_largest_chunk_is_a_request_error(tmp_path):
    build_hf_vlm(tmp_path, seed=6)
    engine = Engine(load_pretrained(tmp_path), EngineConfig(max_slots=1, max_len=MAX_LEN, prefill_chunks=(3,)))
    with pytest.raises(RequestError, match=r"image's 4 tokens exceed the largest prefill chunk"):
        engine.generate_sync(image_prompt([1], 1, [5]), SamplingParams(max_tokens=1),
                             images=_images(1, seed=0))
    engine.stop()
