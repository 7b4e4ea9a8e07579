"""Engine output equals a plain full-forward loop, for every model family.

For each family (tiny random Hugging Face checkpoints from tests/models/hf_fixtures.py): greedy
completions equal a greedy loop over full forward passes, token for token; the returned
logprobs equal log_softmax of a full forward pass over the completed sequence within 1e-4; and
a batch of mixed-length requests (more than there are slots) gives the same tokens as the same
requests one at a time. Both KV layouts: dense rows and the paged block pool (blocks of 5
positions, so blocks straddle chunks and attention buckets).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nonstop.engine import Engine, EngineConfig, SamplingParams
from nonstop.models import load_pretrained
from tests.models.hf_fixtures import FAMILIES, build_hf_model

MAX_LEN = 48
ATOL_LOGPROB = 1e-4
PROMPT_LENGTHS = (1, 5, 11, 20)  # chunk size 8: one partial, one exact+partial, several chunks


@pytest.fixture(scope="module", params=[(f, layout) for f in FAMILIES
                                        for layout in ("dense", "paged")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def family_engine(request, tmp_path_factory):
    family, layout = request.param
    directory = tmp_path_factory.mktemp(family)
    build_hf_model(family, directory, seed=11, num_layers=2)
    model = load_pretrained(directory)
    # Attention buckets 16/32/48: the requests below cross them while decoding.
    engine = Engine(model, EngineConfig(max_slots=3, max_len=MAX_LEN, prefill_chunks=(8,),
                                        decode_buckets=3, kv_layout=layout, block_size=5))
    with engine:
        warm = dict(engine.stats().traces)
        yield model, engine
        assert engine.stats().traces == warm  # nothing compiled after warm-up


@functools.cache
def _forward(model):
    @jax.jit
    def log_probs(tokens):  # [1, MAX_LEN] -> [MAX_LEN, V]; causal, so tail padding is inert
        return jax.nn.log_softmax(model(tokens)[0][0], axis=-1)
    return log_probs


def _reference_greedy(model, prompt, n):
    forward = _forward(model)
    seq = list(prompt)
    buf = np.zeros((1, MAX_LEN), np.int32)
    for _ in range(n):
        buf[0, :len(seq)] = seq
        seq.append(int(np.argmax(np.asarray(forward(jnp.asarray(buf)))[len(seq) - 1])))
    return seq[len(prompt):]


def _prompt(n, seed):
    return np.random.RandomState(seed).randint(3, 257, n).tolist()


def test_greedy_equals_full_forward_loop_and_logprobs_match(family_engine):
    model, engine = family_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=9)
    for i, n in enumerate(PROMPT_LENGTHS):
        prompt = _prompt(n, seed=i)
        completion = engine.generate_sync(prompt, greedy)
        assert completion.finish_reason == "length"
        assert list(completion.tokens) == _reference_greedy(model, prompt, 9)
        full = np.zeros((1, MAX_LEN), np.int32)
        seq = prompt + list(completion.tokens)
        full[0, :len(seq)] = seq
        lp = np.asarray(_forward(model)(jnp.asarray(full)))
        expected = lp[np.arange(n - 1, len(seq) - 1), completion.tokens]
        np.testing.assert_allclose(completion.logprobs, expected, atol=ATOL_LOGPROB, rtol=0)
        assert completion.policy_versions == (0,) * 9


def test_mixed_batch_equals_one_at_a_time(family_engine):
    _, engine = family_engine
    lengths = (3, 17, 1, 9, 25)  # five requests, three slots: two wait for a free slot
    requests = [(_prompt(n, seed=20 + i), SamplingParams(temperature=0.0, max_tokens=4 + 3 * i))
                for i, n in enumerate(lengths)]
    alone = [engine.generate_sync(p, s).tokens for p, s in requests]
    futures = [engine.submit(p, s) for p, s in requests]
    together = [f.result(timeout=120).tokens for f in futures]
    assert together == alone
    assert [len(t) for t in together] == [4 + 3 * i for i in range(5)]
