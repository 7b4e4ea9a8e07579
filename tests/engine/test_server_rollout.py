"""The /nonstop routes a trainer drives, against a real `nonstop serve` process on a tiny
checkpoint: weights posted as the body or through shared memory (tokens and log-probs then equal
an in-process Engine's on those weights), refused weights (the old ones stay), pause and resume,
sessions by `session_id` (cached turns give the same tokens; DELETE and the idle sweep close
them), and the API key on every new route.

One server for the module (default session TTL); a second one, with `--session-ttl-s`, for the
sweep and for what the server leaves of a shared-memory segment when it exits. The tests run in
file order: the weight versions build on each other.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from nonstop.engine.config import EngineConfig
from nonstop.engine.engine import Engine
from nonstop.engine.sampling import SamplingParams
from nonstop.engine.weight_transfer import encode_weights
from nonstop.models import load_pretrained
from nonstop.models.tokenizer import Tokenizer
from tests.engine.test_server import (
    API_KEY,
    MAX_LEN,
    MAX_SLOTS,
    build_checkpoint,
    start_server,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = [[285, 51, 257, 220], [7, 11, 13, 17, 19, 23], list(range(40, 70))]
MAX_TOKENS = 9
TTL_S = 3.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("rollout_model", numbered=False))


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with start_server(checkpoint, tmp_path_factory.mktemp("log") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=120.0, headers=AUTH) as http:
        yield http


@pytest.fixture(scope="module")
def split(checkpoint: Path) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, params, rest) of the checkpoint's model, as a trainer holds them."""
    return nnx.split(load_pretrained(checkpoint), nnx.Param, ...)


def reseeded(params: nnx.State, seed: int) -> nnx.State:
    """Other weights for the same config (drawn as `build_checkpoint` draws its own)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.2
                                              + (0.5 if x.ndim == 1 else 0.0), x.dtype), params)


@pytest.fixture(scope="module")
def weights(split) -> dict[int, nnx.State]:
    """The weights posted as each version: 1 and 2 are new, 0 is the checkpoint's."""
    _, params, _ = split
    return {0: params, 1: reseeded(params, 1), 2: reseeded(params, 2)}


@pytest.fixture(scope="module")
def local(split, weights, checkpoint: Path, server: str) -> Iterator[Engine]:
    """An in-process Engine on version 1's weights, with the server's settings."""
    del server  # started first, so the server compiles while this process does
    graphdef, _, rest = split
    engine = Engine(nnx.merge(graphdef, weights[1], rest),
                    EngineConfig(max_slots=MAX_SLOTS, max_len=MAX_LEN),
                    tokenizer=Tokenizer.from_pretrained(checkpoint), policy_version=1)
    with engine:
        yield engine


def blob_of(split, params: nnx.State) -> bytes:
    graphdef, _, rest = split
    return encode_weights(graphdef, params, rest, np.float32)


def greedy(client: httpx.Client, prompt: list[int], max_tokens: int = MAX_TOKENS,
           **extra) -> dict:
    response = client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "logprobs": 0, "return_token_ids": True, **extra})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    return choice


def served(client: httpx.Client) -> list[tuple[list[int], list[float], list[int]]]:
    """(tokens, logprobs, versions) of the server's greedy continuation of each prompt."""
    out = []
    for prompt in PROMPTS:
        choice = greedy(client, prompt)
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"],
                    choice["policy_versions"]))
    return out


def assert_matches_local(client: httpx.Client, local: Engine, version: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for (tokens, logprobs, versions), prompt in zip(served(client), PROMPTS, strict=True):
        expected = local.generate_sync(prompt, params, timeout=120)
        assert tokens == list(expected.tokens)
        np.testing.assert_allclose(logprobs, expected.logprobs, atol=1e-4, rtol=0)
        assert versions == [version] * MAX_TOKENS == list(expected.policy_versions)


def state(client: httpx.Client) -> dict:
    response = client.get("/nonstop/state")
    assert response.status_code == 200, response.text
    return response.json()


def cached_tokens(client: httpx.Client) -> int:
    """KV-cache positions holding tokens (of running requests and idle sessions), from /metrics."""
    metrics = client.get("/metrics").text
    (ratio,) = [float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("nonstop_kv_cache_usage_ratio ")]
    return round(ratio * MAX_SLOTS * MAX_LEN)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# ---------------------------------------------------------------- state and auth


def test_state(client: httpx.Client):
    assert state(client) == {"policy_version": 0, "paused": False, "running": 0, "waiting": 0,
                             "max_slots": MAX_SLOTS, "max_len": MAX_LEN, "sessions": 0,
                             "model": "rollout_model"}


def test_new_routes_need_the_api_key(server: str, client: httpx.Client):
    for key in (None, "wrong"):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=server, timeout=60.0, headers=headers) as http:
            for response in (http.get("/nonstop/state"), http.post("/nonstop/pause"),
                             http.post("/nonstop/resume"),
                             http.post("/nonstop/weights", params={"version": 5},
                                       content=b"x",
                                       headers={"Content-Type": "application/octet-stream"}),
                             http.delete("/nonstop/sessions/s")):
                assert error_of(response, 401)["type"] == "authentication_error"
    assert state(client)["paused"] is False and state(client)["policy_version"] == 0


# ---------------------------------------------------------------- weights


def test_weights_in_the_body(client: httpx.Client, local: Engine, split, weights):
    before = served(client)
    blob = blob_of(split, weights[1])
    response = client.post("/nonstop/weights", params={"version": 1}, content=blob,
                           headers={"Content-Type": "application/octet-stream"})
    assert response.status_code == 200, response.text
    reply = response.json()
    assert set(reply) == {"policy_version", "seconds", "bytes"}
    assert reply["policy_version"] == 1 and reply["bytes"] == len(blob)
    assert 0 < reply["seconds"] < 60
    assert state(client)["policy_version"] == 1
    assert_matches_local(client, local, 1)
    assert [t for t, _, _ in served(client)] != [t for t, _, _ in before]  # new weights, new text


def test_weights_through_shared_memory(client: httpx.Client, local: Engine, split, weights):
    blob = blob_of(split, weights[2])
    segment = shared_memory.SharedMemory(create=True, size=len(blob))
    try:
        segment.buf[:len(blob)] = blob
        response = client.post("/nonstop/weights", json={"version": 2, "shm": segment.name,
                                                          "nbytes": len(blob)})
        assert response.status_code == 200, response.text
        assert response.json()["policy_version"] == 2 and response.json()["bytes"] == len(blob)
        shared_memory.SharedMemory(name=segment.name).close()  # the server left it in place
    finally:
        segment.close()
        segment.unlink()
    local.update_weights(weights[2], 2)
    assert_matches_local(client, local, 2)
    error = error_of(client.post("/nonstop/weights", json={"version": 3, "shm": segment.name,
                                                           "nbytes": len(blob)}), 400)
    assert error["param"] == "shm" and segment.name in error["message"]


def test_refused_weights_keep_the_old_ones(client: httpx.Client, local: Engine, split, weights):
    tensors = load_safetensors(blob_of(split, weights[0]))
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    reshaped = {**tensors, "model.norm.weight": np.ones(45, np.float32)}
    octet = {"Content-Type": "application/octet-stream"}
    for bad, tensor in [(missing, "model.layers.1.mlp.up_proj.weight"),
                        (reshaped, "model.norm.weight")]:
        error = error_of(client.post("/nonstop/weights", params={"version": 3},
                                     content=save_safetensors(bad), headers=octet), 400)
        assert tensor in error["message"], error
    error = error_of(client.post("/nonstop/weights", params={"version": 1},
                                 content=save_safetensors(tensors), headers=octet), 409)
    assert "version 1" in error["message"] and "version 2" in error["message"]
    for params in ({}, {"version": "-1"}, {"version": "two"}):
        error = error_of(client.post("/nonstop/weights", params=params,
                                     content=save_safetensors(tensors), headers=octet), 400)
        assert error["param"] == "version"
    blob = save_safetensors(tensors)
    for garbage, why in [(b"tiny", "shorter than its header"),
                         (blob[:len(blob) // 2], "truncated"),
                         (b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]", "not a JSON object")]:
        error = error_of(client.post("/nonstop/weights", params={"version": 3},
                                     content=garbage, headers=octet), 400)
        assert why in error["message"] and "keeps its weights" in error["message"], error
    assert state(client)["policy_version"] == 2
    assert_matches_local(client, local, 2)


def test_bfloat16_weights(client: httpx.Client, local: Engine, split, weights):
    """A bfloat16 blob (what RemoteEngine(weight_dtype="bfloat16") sends) loads into the
    float32 server: its tokens are those of the weights rounded to bfloat16."""
    graphdef, _, rest = split
    blob = encode_weights(graphdef, weights[1], rest, jnp.bfloat16)
    assert len(blob) < len(blob_of(split, weights[1])) * 0.6
    response = client.post("/nonstop/weights", params={"version": 3}, content=blob,
                           headers={"Content-Type": "application/octet-stream"})
    assert response.status_code == 200, response.text
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), weights[1])
    local.update_weights(rounded, 3)
    assert_matches_local(client, local, 3)


def test_an_engine_that_does_not_publish_updates_only_servers_behind(
        server: str, client: httpx.Client, local: Engine, split, weights):
    """RemoteEngine(publish=False), as on every process but the first of a multi-process
    trainer: its update posts nothing; its first request to a server behind that update gives
    the server the update first; a server ahead of it keeps its own weights."""
    from nonstop.engine.remote import RemoteEngine

    graphdef, _, rest = split
    model = nnx.merge(graphdef, weights[0], rest)
    current = state(client)["policy_version"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with RemoteEngine(server, api_key=API_KEY, policy=model, max_len=MAX_LEN,
                      publish=False) as engine:
        engine.update_weights(weights[2], current + 1)
        assert state(client)["policy_version"] == current  # nothing posted
        out = asyncio.run(engine.generate(PROMPTS[0], params))
        assert state(client)["policy_version"] == current + 1
    local.update_weights(weights[2], current + 1)
    expected = local.generate_sync(PROMPTS[0], params, timeout=120)
    assert list(out.tokens) == list(expected.tokens)
    assert list(out.policy_versions) == [current + 1] * MAX_TOKENS
    with RemoteEngine(server, api_key=API_KEY, policy=model, max_len=MAX_LEN,
                      publish=False) as engine:
        engine.update_weights(weights[0], current)  # older than the server's
        out = asyncio.run(engine.generate(PROMPTS[0], params))
    assert state(client)["policy_version"] == current + 1
    assert list(out.tokens) == list(expected.tokens)
    assert list(out.policy_versions) == [current + 1] * MAX_TOKENS


# ---------------------------------------------------------------- pause


async def _stream(http: httpx.AsyncClient, body: dict, started: asyncio.Event
                  ) -> tuple[list[int], float]:
    """Stream a completion; set `started` at its first chunk; (token ids, time it ended)."""
    tokens: list[int] = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                tokens += event["choices"][0]["token_ids"]
                started.set()
    return tokens, time.perf_counter()


def test_pause_holds_new_requests_until_resume(server: str, client: httpx.Client):
    long = {"prompt": [5, 6, 7], "max_tokens": MAX_LEN - 4, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=120.0) as http:
            started = [asyncio.Event() for _ in range(MAX_SLOTS)]
            running = [asyncio.create_task(_stream(http, long, s)) for s in started]
            for s in started:
                await s.wait()
            paused = (await http.post("/nonstop/pause")).json()
            assert paused["paused"] is True and paused["running"] >= 1  # in flight, paused
            assert (await http.post("/nonstop/pause")).json()["paused"] is True  # idempotent

            async def held() -> tuple[dict, float]:
                reply = await http.post("/v1/completions", json={**long, "max_tokens": 4})
                assert reply.status_code == 200, reply.text
                return reply.json()["choices"][0], time.perf_counter()

            waiting = asyncio.create_task(held())
            finished = await asyncio.gather(*running)  # running requests go on while paused
            for tokens, _ in finished:
                assert len(tokens) == MAX_LEN - 4
            await asyncio.sleep(0.5)
            now = (await http.get("/nonstop/state")).json()
            assert now["paused"] is True and now["waiting"] == 1 and now["running"] == 0
            assert not waiting.done()
            resumed_at = time.perf_counter()
            assert (await http.post("/nonstop/resume")).json()["paused"] is False
            choice, done_at = await waiting
            assert len(choice["token_ids"]) == 4 and done_at > resumed_at
            assert all(end < resumed_at for _, end in finished)

    asyncio.run(main())
    assert state(client)["paused"] is False


# ---------------------------------------------------------------- sessions


def test_session_turns_match_the_full_prompt(server: str, client: httpx.Client):
    prompt = PROMPTS[1]
    first = greedy(client, prompt, session_id="episode-1")
    assert state(client)["sessions"] == 1
    # The engine keeps the session's cache (the last token is not in it yet): it is a session.
    assert cached_tokens(client) == len(prompt) + MAX_TOKENS - 1
    context = [*prompt, *first["token_ids"], 9, 10, 11]
    second = greedy(client, context, session_id="episode-1")
    alone = greedy(client, context)
    assert second["token_ids"] == alone["token_ids"]
    np.testing.assert_allclose(second["logprobs"]["token_logprobs"],
                               alone["logprobs"]["token_logprobs"], atol=1e-4, rtol=0)
    assert second["policy_versions"] == [state(client)["policy_version"]] * MAX_TOKENS
    assert state(client)["sessions"] == 1

    error = error_of(client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 2, "n": 2, "session_id": "episode-1"}), 400)
    assert error["param"] == "session_id"
    error = error_of(client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 2, "session_id": ""}), 400)
    assert error["param"] == "session_id"

    reply = client.delete("/nonstop/sessions/episode-1")
    assert reply.status_code == 200 and reply.json() == {"session_id": "episode-1",
                                                         "closed": True}
    assert state(client)["sessions"] == 0
    deadline = time.monotonic() + 30.0
    while cached_tokens(client) and time.monotonic() < deadline:  # the engine drops it next
        time.sleep(0.02)
    assert cached_tokens(client) == 0
    error = error_of(client.delete("/nonstop/sessions/episode-1"), 404)
    assert error["type"] == "not_found_error" and "episode-1" in error["message"]


def test_chat_session_turns_and_streams(client: httpx.Client):
    def chat(messages: list[dict], **extra) -> dict:
        reply = client.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]

    messages = [{"role": "user", "content": "What is 7 * 6?"}]
    first = chat(messages, session_id="chat-1")
    messages += [{"role": "assistant", "content": first["message"]["content"]},
                 {"role": "user", "content": "And 7 * 7?"}]
    second = chat(messages, session_id="chat-1")
    assert second["token_ids"] == chat(messages)["token_ids"]
    events = client.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True, "stream": True, "session_id": "chat-1"}).text
    streamed = [t for block in events.split("\n\n") if block.startswith("data: {")
                for t in json.loads(block.removeprefix("data: "))["choices"][0].get("token_ids",
                                                                                    [])]
    assert streamed == second["token_ids"]
    assert state(client)["sessions"] == 1
    assert client.delete("/nonstop/sessions/chat-1").status_code == 200


def test_one_turn_at_a_time_per_session(server: str, client: httpx.Client):
    async def main() -> None:
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=120.0) as http:
            await http.post("/nonstop/pause")  # holds the first turn: it stays in flight
            body = {"prompt": [5, 6], "max_tokens": 3, "session_id": "episode-2"}
            first = asyncio.create_task(http.post("/v1/completions", json=body))
            while (await http.get("/nonstop/state")).json()["waiting"] < 1:
                await asyncio.sleep(0.02)
            error = error_of(await http.post("/v1/completions", json=body), 409)
            assert error["param"] == "session_id" and "in flight" in error["message"]
            await http.post("/nonstop/resume")
            assert (await first).status_code == 200
            second = await http.post("/v1/completions", json=body)  # the turn is over
            assert second.status_code == 200, second.text
            assert (await http.delete("/nonstop/sessions/episode-2")).status_code == 200

    asyncio.run(main())


def test_idle_sessions_are_swept_and_shared_memory_outlives_the_server(
        checkpoint: Path, tmp_path: Path, split, weights):
    log = tmp_path / "ttl_server.log"
    blob = blob_of(split, weights[1])
    segment = shared_memory.SharedMemory(create=True, size=len(blob))
    try:
        segment.buf[:len(blob)] = blob
        with (start_server(checkpoint, log, extra=["--session-ttl-s", str(TTL_S)]) as url,
              httpx.Client(base_url=url, timeout=120.0, headers=AUTH) as http):
            reply = http.post("/nonstop/weights", json={"version": 1, "shm": segment.name,
                                                        "nbytes": len(blob)})
            assert reply.status_code == 200, reply.text
            sent_at = time.perf_counter()
            greedy(http, PROMPTS[0], session_id="idle")
            deadline = sent_at + 10 * TTL_S
            while state(http)["sessions"] and time.perf_counter() < deadline:
                time.sleep(0.1)
            assert state(http)["sessions"] == 0
            assert time.perf_counter() - sent_at > TTL_S
            assert greedy(http, PROMPTS[0], session_id="idle")["policy_versions"] == [1] * 9
        time.sleep(1.0)  # a resource tracker would unlink the segment once the server exits
        shared_memory.SharedMemory(name=segment.name).close()
        assert "leaked shared_memory" not in log.read_text()
    finally:
        segment.close()
        segment.unlink()
