"""RemoteEngine against a real `nonstop serve` process: the same greedy tokens and logprobs as the
local Engine on the same weights, errors surfaced clearly, connection failures retried.

The vLLM-shaped response test uses httpx's MockTransport, since no vLLM server can run here: it
pins the request fields RemoteEngine relies on and the parsing of vLLM's "token_id:{id}" tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from bench.remote_servers import free_port
from nonstop.engine.config import EngineConfig
from nonstop.engine.engine import Engine
from nonstop.engine.remote import RemoteEngine, RemoteEngineError, RemoteRequestError
from nonstop.engine.sampling import SamplingParams
from nonstop.engine.types import Completion, RequestError
from nonstop.models import load_pretrained
from nonstop.models.tokenizer import Tokenizer
from tests.engine.test_server import (
    API_KEY,
    MAX_LEN,
    MAX_SLOTS,
    VOCAB,
    build_checkpoint,
    start_server,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("remote_model", numbered=False))


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with start_server(checkpoint, tmp_path_factory.mktemp("log") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def local(checkpoint: Path, server: str) -> Iterator[Engine]:
    """The local Engine on the same weights and settings as the server."""
    del server  # started first, so the server compiles while this process does
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    engine = Engine(load_pretrained(checkpoint), EngineConfig(max_slots=MAX_SLOTS, max_len=MAX_LEN), tokenizer=tokenizer)
    with engine:
        yield engine


PROMPTS = [[285, 51, 257, 220], [7, 11, 13, 17, 19, 23], list(range(40, 100))]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=(289, 286, 290)),
          SamplingParams(temperature=0.0, max_tokens=13),
          SamplingParams(temperature=0.0, max_tokens=None)]  # runs into the end of the context


def test_remote_matches_local_engine(local: Engine, server: str):
    async def main() -> tuple[list[Completion], list[Completion]]:
        async with RemoteEngine(server, api_key=API_KEY) as remote:
            remote_out = await asyncio.gather(*(remote.generate(p, s)
                                                for p, s in zip(PROMPTS, PARAMS, strict=True)))
            assert await remote.models() == ["remote_model"]
        local_out = await asyncio.gather(*(local.generate(p, s)
                                           for p, s in zip(PROMPTS, PARAMS, strict=True)))
        return list(remote_out), list(local_out)

    remote_out, local_out = asyncio.run(main())
    for r, lo in zip(remote_out, local_out, strict=True):
        assert r.tokens == lo.tokens and len(r.tokens) > 0
        np.testing.assert_allclose(r.logprobs, lo.logprobs, atol=1e-5, rtol=0)
        assert r.policy_versions == lo.policy_versions
        assert r.finish_reason == lo.finish_reason
        assert r.stop_reason == lo.stop_reason
    # The third request filled the context: the engine's own reason comes through.
    assert local_out[2].finish_reason == "cache_full"
    assert len(local_out[2].tokens) == MAX_LEN - len(PROMPTS[2])


def test_http_errors_are_clear(server: str):
    async def main() -> None:
        async with RemoteEngine(server, api_key=API_KEY, model="remote_model") as remote:
            with pytest.raises(RemoteRequestError) as info:
                await remote.generate([5, VOCAB + 1], SamplingParams(max_tokens=2))
            assert isinstance(info.value, RequestError) and info.value.status == 400
            assert "outside the vocabulary" in str(info.value)
            with pytest.raises(RemoteRequestError, match="does not exist") as info:
                remote.model = "some-other-model"
                await remote.generate([5], SamplingParams(max_tokens=2))
            assert info.value.status == 404
        async with RemoteEngine(server, api_key="wrong", model="remote_model") as remote:
            with pytest.raises(RemoteRequestError, match="API key") as info:
                await remote.generate([5], SamplingParams(max_tokens=2))
            assert info.value.status == 401

    asyncio.run(main())


class _FailingFirst(httpx.AsyncBaseTransport):
    """The real transport, except that the first `failures` requests fail to connect."""

    def __init__(self, failures: int):
        self.failures = failures
        self.attempts = 0
        self._real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise httpx.ConnectError("connection refused (injected)", request=request)
        return await self._real.handle_async_request(request)

    async def aclose(self) -> None:
        await self._real.aclose()


def test_connection_errors_are_retried(server: str):
    params = SamplingParams(temperature=0.0, max_tokens=3)

    async def main() -> None:
        transport = _FailingFirst(failures=2)
        async with RemoteEngine(server, api_key=API_KEY, model="remote_model", max_retries=2,
                                retry_backoff_s=0.01, transport=transport) as remote:
            out = await remote.generate([7, 11], params)
        # Two refused probes of /nonstop/state, the probe that answers, then the completion.
        assert transport.attempts == 4 and len(out.tokens) == 3
        assert remote.stats().server_failures == 2 and remote.stats().servers_up == 1
        # Nothing listens on a fresh port: every attempt is refused, then a clear error.
        async with RemoteEngine(f"http://127.0.0.1:{free_port()}", model="m", max_retries=2,
                                retry_backoff_s=0.01) as remote:
            with pytest.raises(RemoteEngineError, match="after 3 attempts"):
                await remote.generate([7, 11], params)

    asyncio.run(main())


def test_vllm_style_response_and_request_fields():
    """vLLM (without nonstop's extensions): ids from 'token_id:N', a constant policy version."""
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":  # vLLM has no /nonstop/state
            return httpx.Response(404, json={"detail": "Not Found"})
        seen.append(json.loads(request.content))
        assert request.headers["authorization"] == "Bearer k"
        return httpx.Response(200, json={"id": "cmpl-1", "object": "text_completion",
                                          "choices": [{
                                              "index": 0, "text": "ab", "finish_reason": "stop",
                                              "stop_reason": 9,
                                              "logprobs": {"tokens": ["token_id:4", "token_id:9"],
                                                           "token_logprobs": [-0.5, -1.25],
                                                           "top_logprobs": None,
                                                           "text_offset": [0, 1]}}]})

    async def main() -> Completion:
        async with RemoteEngine("http://127.0.0.1:9/v1/", api_key="k", model="served",
                                policy_version=7, transport=httpx.MockTransport(handler)) as remote:
            return await remote.generate([1, 2, 3], SamplingParams(
                temperature=0.7, top_k=5, top_p=0.9, max_tokens=4, stop_token_ids=(9,),
                stop=("zz",), seed=11))

    out = asyncio.run(main())
    assert out.tokens == (4, 9) and out.logprobs == (-0.5, -1.25)
    assert out.policy_versions == (7, 7) and out.finish_reason == "stop" and out.stop_reason == 9
    (body,) = seen
    assert body == {"model": "served", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.7,
                    "top_p": 0.9, "top_k": 5, "stop_token_ids": [9], "ignore_eos": True,
                    "skip_special_tokens": False, "logprobs": 0, "return_token_ids": True,
                    "return_tokens_as_token_ids": True, "n": 1, "stream": False,
                    "stop": ["zz"], "seed": 11}


def test_requests_past_the_servers_slots_wait_here(local: Engine, server: str):
    """Three times the server's slots at once: at most its slots are sent, the rest wait in
    the client (counted as `waiting`), and every request gets the local engine's tokens."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5)] for i in range(3 * MAX_SLOTS)]
    params = SamplingParams(temperature=0.0, max_tokens=6)

    async def main() -> tuple[list[Completion], list[tuple[int, int]]]:
        seen: list[tuple[int, int]] = []
        async with RemoteEngine(server, api_key=API_KEY) as remote:
            tasks = [asyncio.ensure_future(remote.generate(p, params)) for p in prompts]
            while not all(t.done() for t in tasks):
                stats = remote.stats()
                seen.append((stats.active_slots, stats.waiting))
                await asyncio.sleep(0.001)
            assert remote.stats().waiting == 0 and remote.stats().active_slots == 0
            return [t.result() for t in tasks], seen

    got, seen = asyncio.run(main())
    assert max(active for active, _ in seen) <= MAX_SLOTS
    assert max(waiting for _, waiting in seen) >= MAX_SLOTS  # the surplus waited here
    want = asyncio.run(_generate_all(local, prompts, params))
    assert [c.tokens for c in got] == [c.tokens for c in want]


async def _generate_all(engine: Engine, prompts: list[list[int]],
                        params: SamplingParams) -> list[Completion]:
    return list(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))
