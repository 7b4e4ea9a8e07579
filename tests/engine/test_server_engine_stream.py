"""`Engine.stream`, the per-request hook the server's streaming is built on: chunks arrive as the
device produces them, add up to the completion, and leaving early frees the slot at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from nonstop.engine import Engine, EngineConfig, SamplingParams
from tests.engine.engine_fixtures import random_prompt, sharp_tiny_model


@pytest.fixture(scope="module")
def engine():
    with Engine(sharp_tiny_model(1), EngineConfig(max_slots=2, max_len=96,
                                                  prefill_chunks=(16,))) as e:
        yield e


def test_stream_chunks_add_up_to_the_completion(engine):
    prompt, params = random_prompt(9, 0), SamplingParams(temperature=0.0, max_tokens=40)

    async def main():
        chunks = [c async for c in engine.stream(prompt, params)]
        return chunks, await engine.generate(prompt, params)

    chunks, whole = asyncio.run(main())
    assert len(chunks) > 1 and chunks[-1].completion is not None
    assert all(c.completion is None for c in chunks[:-1])
    assert [t for c in chunks for t in c.tokens] == list(whole.tokens)
    assert [lp for c in chunks for lp in c.logprobs] == pytest.approx(whole.logprobs, abs=1e-6)
    assert chunks[-1].completion.tokens == whole.tokens


def test_leaving_a_stream_early_frees_its_slot(engine):
    params = SamplingParams(temperature=0.0, max_tokens=80)

    async def main():
        async with asyncio.timeout(60):
            stream = engine.stream(random_prompt(5, 1), params)
            first = await anext(stream)
            await stream.aclose()
            deadline = time.monotonic() + 10
            while engine.stats().active_slots and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return first

    first = asyncio.run(main())
    assert first.completion is None and len(first.tokens) >= 1
    assert engine.stats().active_slots == 0
