"""The OpenAI-compatible server, run as a real `nonstop serve` process on a tiny checkpoint.

One server process per module (uvicorn on 127.0.0.1, a free port, an API key), always terminated
by the fixture's finalizer. The wire format is checked against the tokenizer and chat template
directly; parity with the local Engine is in test_remote.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from safetensors.numpy import save_file

import nonstop
from bench.remote_servers import free_port, wait_healthy
from bench.server_load import gauge, run_load, wait_idle
from nonstop.engine import openai_protocol as wire
from nonstop.engine.server import text_deltas
from nonstop.engine.server_app import ServerConfig
from nonstop.models import ModelConfig, load_pretrained
from nonstop.models.chat import ChatTemplate
from nonstop.models.hf_weights import weight_specs
from nonstop.models.tokenizer import Tokenizer
from nonstop.models.validation import ConfigError
from tests.models.tokenizer_fixtures import build_tiny_tokenizer

VOCAB = 293  # prime; the tiny llama3 tokenizer is trained to exactly this many ids
MAX_LEN = 127
MAX_SLOTS = 3
API_KEY = "test-key-7f3a"


def build_checkpoint(directory: Path) -> Path:
    """A tiny Llama 3 checkpoint directory: the tiny tokenizer, config.json and random weights
    (written with numpy: quicker than initialising the decoder on a shared CPU)."""
    build_tiny_tokenizer(directory, "llama3", vocab_size=VOCAB)
    tokenizer = Tokenizer.from_pretrained(directory)
    cfg = ModelConfig.tiny("llama", vocab_size=VOCAB, bos_token_id=tokenizer.bos_id,
                           eos_token_ids=tokenizer.eos_ids, pad_token_id=tokenizer.pad_id)
    rng = np.random.default_rng(0)
    tensors = {s.hf_name: (rng.standard_normal(s.hf_shape) * 0.2
                           + (0.5 if len(s.hf_shape) == 1 else 0.0)).astype(np.float32)
               for s in weight_specs(cfg)}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({**cfg.to_hf(), "dtype": "float32"}))
    return directory


@contextlib.contextmanager
def spawn_server(model_dir: Path, log_path: Path, *, api_key: str | None = API_KEY,
                 extra: Sequence[str] = (), env: dict[str, str] | None = None
                 ) -> Iterator[tuple[subprocess.Popen, str]]:
    """Run `nonstop serve` in a subprocess on a free loopback port; yield (process, base URL) at
    once (see `wait_healthy`); terminate it (kill if it lingers) on exit, whatever happened."""
    port = free_port()
    command = [sys.executable, "-m", "nonstop.cli.serve", str(model_dir), "--host", "127.0.0.1",
               "--port", str(port), "--max-len", str(MAX_LEN), "--max-slots", str(MAX_SLOTS),
               "--log-level", "warning", *extra]
    if api_key is not None:
        command += ["--api-key", api_key]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1", **(env or {}))
    env.pop("NONSTOP_API_KEY", None)
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            yield process, base_url
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)


@contextlib.contextmanager
def start_server(model_dir: Path, log_path: Path, *, api_key: str | None = API_KEY,
                 extra: Sequence[str] = ()) -> Iterator[str]:
    """`spawn_server`, yielding its base URL once it is healthy."""
    with spawn_server(model_dir, log_path, api_key=api_key, extra=extra) as (process, url):
        wait_healthy(process, url, log_path)
        yield url


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("served_model", numbered=False))


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("log") / "server.log"


@pytest.fixture(scope="module")
def server(checkpoint: Path, server_log: Path) -> Iterator[str]:
    with start_server(checkpoint, server_log) as url:
        yield url


@pytest.fixture(scope="module")
def oai(server: str) -> openai.OpenAI:
    """The official client, as agents and harnesses use it."""
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def log_softmax(checkpoint: Path):
    """The reference: log-softmax of a full forward of the checkpoint, row t predicting t + 1."""
    model = load_pretrained(checkpoint)
    forward = jax.jit(lambda tokens: jax.nn.log_softmax(model(tokens[None])[0][0], axis=-1))
    return lambda tokens: np.asarray(forward(jnp.asarray(tokens, jnp.int32)))


@pytest.fixture(scope="module")
def client(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=120.0,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        yield http


def _sse(text: str) -> list[dict]:
    """The JSON events of an SSE body, checking its framing and the final [DONE]."""
    events = [block for block in text.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in events), events[:3]
    assert events[-1] == "data: [DONE]"
    return [json.loads(block.removeprefix("data: ")) for block in events[:-1]]


# ---------------------------------------------------------------- pure pieces (no server)


def test_parse_completion_request_validates_fields():
    req = wire.parse_completion_request({"prompt": [[3, 5], "hi"], "top_k": -1, "stop": "x",
                                         "n": 2, "logprobs": 0})
    assert req.prompts == ((3, 5), "hi") and req.sampling.top_k is None
    assert req.sampling.stop == ("x",) and req.sampling.n == 2 and req.logprobs == 0
    assert req.sampling.max_tokens == 16  # OpenAI's completions default
    for body, param in [({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"),
                        ({"prompt": [1, "a"]}, "prompt"), ({"prompt": "a", "temperature": -1},
                                                           "temperature"),
                        ({"prompt": "a", "top_p": 0}, "top_p"), ({"prompt": "a", "n": 0}, "n"),
                        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "a", "stream": "yes"}, "stream"),
                        ({"prompt": "a", "stop": 3}, "stop"),
                        ({"prompt": "a", "presence_penalty": 0.5}, "presence_penalty")]:
        with pytest.raises(wire.ProtocolError) as info:
            wire.parse_completion_request(body)
        assert info.value.param == param and info.value.status == 400


def test_parse_chat_request_reads_tool_choice():
    hi = [{"role": "user", "content": "hi"}]
    assert wire.parse_chat_request({"messages": hi}).tool_choice == "none"
    req = wire.parse_chat_request({"messages": hi, "tools": TOOLS, "parallel_tool_calls": False})
    assert req.tool_choice == "auto" and req.parallel_tool_calls is False
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert wire.parse_chat_request({"messages": hi, "tools": TOOLS,
                                    "tool_choice": named}).tool_choice == "get_weather"
    for choice in ("none", "auto", "required"):
        assert wire.parse_chat_request({"messages": hi, "tools": TOOLS,
                                        "tool_choice": choice}).tool_choice == choice
    assert wire.parse_chat_request({"messages": hi, "response_format": {"type": "text"}})


def test_text_deltas_hold_back_partial_utf8_and_cut_at_stop(tokenizer: Tokenizer):
    text = "Naïve café 🙂 and the answer is 42."
    ids = tokenizer.encode(text)
    deltas = text_deltas(tokenizer, ids, skip_special_tokens=True)
    assert "".join(deltas) == text == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    cut = text_deltas(tokenizer, ids, skip_special_tokens=True, stop=("answer", "zzz"))
    assert len(cut) == len(ids) and "".join(cut) == text[: text.index("answer")]


# ---------------------------------------------------------------- the running server


def test_models_and_health(client: httpx.Client, server: str):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["served_model"]
    assert models["data"][0]["max_model_len"] == MAX_LEN
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}  # no key needed


def test_api_key_is_enforced(server: str):
    body = {"prompt": [5, 6], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server}/v1/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server}/v1/models").status_code == 401


def test_completion_matches_the_openai_schema(client: httpx.Client, tokenizer: Tokenizer):
    prompt = "The quick brown fox"
    body = {"model": "served_model", "prompt": prompt, "max_tokens": 9, "temperature": 0.0,
            "logprobs": 0, "return_token_ids": True}
    out = client.post("/v1/completions", json=body).json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["model"] == "served_model" and isinstance(out["created"], int)
    (choice,) = out["choices"]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    assert choice["prompt_token_ids"] == prompt_ids and prompt_ids[0] == tokenizer.bos_id
    ids = choice["token_ids"]
    assert 1 <= len(ids) <= 9 and all(0 <= t < VOCAB for t in ids)
    assert choice["finish_reason"] == ("stop" if ids[-1] in tokenizer.eos_ids else "length")
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert len(logprobs["token_logprobs"]) == len(ids)
    assert all(lp <= 0.0 for lp in logprobs["token_logprobs"])
    assert [list(d.values()) for d in logprobs["top_logprobs"]] == [
        [lp] for lp in logprobs["token_logprobs"]]
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(
        logprobs["text_offset"])
    assert len(choice["policy_versions"]) == len(ids)
    assert out["usage"] == wire.usage(len(prompt_ids), len(ids))
    # The same prompt as token ids gives the same greedy tokens; vLLM's token_id spelling.
    by_ids = client.post("/v1/completions", json={**body, "prompt": prompt_ids,
                                                  "return_tokens_as_token_ids": True}).json()
    again = by_ids["choices"][0]
    assert again["token_ids"] == ids
    assert again["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    np.testing.assert_allclose(again["logprobs"]["token_logprobs"], logprobs["token_logprobs"],
                               atol=1e-5)


def test_stop_string_ends_the_text_before_it(client: httpx.Client, tokenizer: Tokenizer):
    body = {"prompt": [7, 11, 13], "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    free = client.post("/v1/completions", json=body).json()["choices"][0]
    text = free["text"]
    stop = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"greedy text {text!r} has no two-character stop candidate")
    cut = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(stop)]
    assert cut["token_ids"] == free["token_ids"][: len(cut["token_ids"])]
    assert stop in tokenizer.decode(cut["token_ids"])  # the stop's tokens are kept


def test_chat_completion_uses_the_chat_template(client: httpx.Client, tokenizer: Tokenizer):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": [{"type": "text", "text": "What is 7 * 6?"}]}]
    out = client.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True,
        "return_token_ids": True}).json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    (choice,) = out["choices"]
    rendered = ChatTemplate.from_tokenizer(tokenizer).render(
        [messages[0], {"role": "user", "content": "What is 7 * 6?"}], add_generation_prompt=True)
    assert choice["prompt_token_ids"] == tokenizer.encode(rendered)
    assert choice["message"]["role"] == "assistant"
    ids = choice["token_ids"]
    assert choice["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [tokenizer.decode([t]) for t in ids]
    assert all(c["bytes"] == list(c["token"].encode()) and c["logprob"] <= 0 for c in content)
    assert out["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_stream_reassembles_to_the_unstreamed_result(client: httpx.Client, route: str):
    body = {"max_tokens": 8, "temperature": 0, "n": 2, "return_token_ids": True}
    if route == "/v1/completions":
        body |= {"prompt": "Answer the question", "logprobs": 0}
    else:
        body |= {"messages": [{"role": "user", "content": "Paris?"}], "logprobs": True}
    whole = client.post(route, json=body).json()
    response = client.post(route, json=body | {"stream": True,
                                               "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _sse(response.text)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    for choice in whole["choices"]:
        parts = [c for e in events[:-1] for c in e["choices"] if c["index"] == choice["index"]]
        assert all(e["id"] == events[0]["id"] for e in events)
        if route == "/v1/completions":
            text = "".join(p["text"] for p in parts)
            logprobs = [lp for p in parts for lp in p["logprobs"]["token_logprobs"]]
            assert text == choice["text"]
            assert logprobs == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-5)
        else:
            assert parts[0]["delta"]["role"] == "assistant"
            text = "".join(p["delta"].get("content", "") for p in parts)
            logprobs = [c["logprob"] for p in parts if p["logprobs"]
                        for c in p["logprobs"]["content"]]
            assert text == choice["message"]["content"]
            assert logprobs == pytest.approx([c["logprob"] for c in choice["logprobs"]["content"]],
                                             abs=1e-5)
        assert [t for p in parts for t in p.get("token_ids", [])] == choice["token_ids"]
        assert [p["finish_reason"] for p in parts][-1] == choice["finish_reason"]
        assert all(p["finish_reason"] is None for p in parts[:-1])


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": list(range(1, MAX_LEN + 5)), "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [5, VOCAB], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [5, -1], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [5], "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": [5], "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": [5], "top_k": -7}, "top_k"),
    ("/v1/completions", {"prompt": [5], "stop_token_ids": [VOCAB + 3]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [5], "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": [5], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [5], "echo": True, "stream": True}, "echo"),
    ("/v1/completions", {"prompt": [5], "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": [5], "stream": True,
                         "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ("/v1/completions", {"prompt": [5], "min_p": 0.1}, "min_p"),
    ("/v1/completions", b'{"prompt": [5], "max_tokens": ', None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    *[("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **extra}, param)
      for extra, param in [
          ({"response_format": {"type": "json_object"}}, "response_format"),
          ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
          ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
           "tool_choice"),
          ({"tool_choice": "required"}, "tool_choice"),
          ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
          ({"tools": [{"type": "function"}]}, "tools"),
          ({"functions": [{"name": "f"}]}, "functions"),
          ({"function_call": "auto"}, "function_call"),
          ({"guided_json": {"type": "object"}}, "guided_json"),
          ({"logit_bias": {"5": 3}}, "logit_bias"),
          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
          ({"top_logprobs": 2}, "top_logprobs"),
          ({"presence_penalty": 0.5}, "presence_penalty"),
          ({"reasoning_effort": "low"}, "reasoning_effort"),
          ({"store": True}, "store"),
      ]],
]


def test_bad_requests_get_400_while_a_good_request_succeeds(server: str):
    async def main() -> tuple[httpx.Response, list[httpx.Response]]:
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        async with httpx.AsyncClient(base_url=server, headers=headers, timeout=120.0) as http:
            good = http.post("/v1/completions", json={"prompt": [7, 11, 13], "max_tokens": 10,
                                                      "temperature": 0, "ignore_eos": True})
            bad = [http.post(route, content=body if isinstance(body, bytes) else json.dumps(body))
                   for route, body, _ in BAD_REQUESTS]
            good_response, *bad_responses = await asyncio.gather(good, *bad)
            return good_response, bad_responses

    good, bad = asyncio.run(main())
    for (route, body, param), response in zip(BAD_REQUESTS, bad, strict=True):
        assert response.status_code == 400, (route, body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        assert error["param"] == param, (body, error)
    assert good.status_code == 200
    choice = good.json()["choices"][0]
    assert choice["finish_reason"] == "length" and good.json()["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"port": 65536}, r"^ServerConfig\.port=65536 is invalid; expected an int in \[0, 65535\]$"),
        ({"engine": {"max_slots": 0}},
         r"^ServerConfig\.engine=\{'max_slots': 0\} is invalid; expected an EngineConfig$"),
        ({"dtype": "float16"},
         r"^ServerConfig\.dtype='float16' is invalid; expected one of 'float32', 'bfloat16'$"),
        ({"api_key": ""}, r"^ServerConfig\.api_key='' is invalid; expected None "),
    ],
)
def test_server_config_errors_name_field_value_and_valid_range(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ServerConfig(model_dir="ckpt", **kwargs)


def _extra(obj, key: str):
    """A vLLM/nonstop field the openai client keeps beside its own (pydantic extras)."""
    return (obj.model_extra or {}).get(key)


# ---------------------------------------------------------------- through the official client


def test_startup_progress_and_ready_line(server: str, server_log: Path):
    text = server_log.read_text()
    assert "nonstop serve: loaded" in text and "compiling the engine" in text
    assert f"nonstop serve: ready at {server}/v1 (model 'served_model'" in text


def _stream_timeline(stream, client: httpx.Client) -> tuple[list[float], list[int], int]:
    """(arrival times, tokens per chunk, tokens that existed when the first chunk arrived) of a
    streamed response; the last is read from /metrics as soon as the first chunk is in."""
    before = gauge(client.get("/metrics").text, "nonstop_generation_tokens_total")
    arrivals, counts, existing = [], [], None
    start = time.perf_counter()
    for chunk in stream:
        for choice in chunk.choices:
            if ids := _extra(choice, "token_ids"):
                arrivals.append(time.perf_counter() - start)
                counts.append(len(ids))
                if existing is None:
                    metrics = client.get("/metrics").text
                    existing = gauge(metrics, "nonstop_generation_tokens_total") - before
    return arrivals, counts, existing


def test_streams_are_incremental(oai: openai.OpenAI, client: httpx.Client):
    """The first chunk arrives while fewer than half of the completion's tokens exist (the
    server's token counter, read when it arrives, says so), and chunks keep arriving after it:
    each carries the tokens of one engine decode call (more if the reader lags)."""
    n = 100
    body = {"model": "served_model", "max_tokens": n, "temperature": 0, "stream": True,
            "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    list(oai.completions.create(prompt=[5], **body | {"max_tokens": 2}))  # the client warms up
    stream = oai.completions.create(prompt=[7, 11, 13], stream_options={"include_usage": True},
                                    **body)
    arrivals, counts, existing = _stream_timeline(stream, client)
    assert sum(counts) == n and existing < n / 2, (counts[:5], existing)
    assert len(counts) >= 5 and arrivals[-1] > arrivals[0]
    stream = oai.chat.completions.create(
        messages=[{"role": "user", "content": "Tell me a story."}], **body | {"max_tokens": 80})
    arrivals, counts, existing = _stream_timeline(stream, client)
    assert sum(counts) == 80 and existing < 40, (counts[:5], existing)
    assert len(counts) >= 5 and arrivals[-1] > arrivals[0]


def test_a_disconnecting_client_frees_its_slot(client: httpx.Client, server: str):
    before = gauge(client.get("/metrics").text, "nonstop_generation_tokens_total")
    body = {"prompt": [9, 8, 7], "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    assert wait_idle(server) == {"nonstop_slots_in_use": 0, "nonstop_requests_running": 0,
                                 "nonstop_queue_depth": 0}
    generated = gauge(client.get("/metrics").text, "nonstop_generation_tokens_total") - before
    assert generated < 120  # the engine stopped generating for it


def test_a_client_that_gives_up_on_a_plain_request_frees_its_slot(client: httpx.Client,
                                                                  server: str):
    before = gauge(client.get("/metrics").text, "nonstop_generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", timeout=0.3, json={
            "prompt": [4, 5, 6], "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "n": 60})  # 60 x 120 tokens on 3 slots: seconds
    assert wait_idle(server)["nonstop_slots_in_use"] == 0
    generated = gauge(client.get("/metrics").text, "nonstop_generation_tokens_total") - before
    assert generated < 60 * 120


def test_top_logprobs_equal_the_log_softmax(oai: openai.OpenAI, log_softmax):
    prompt = [7, 11, 13, 17]
    out = oai.completions.create(model="served_model", prompt=prompt, max_tokens=6,
                                 temperature=0, logprobs=5,
                                 extra_body={"ignore_eos": True, "return_token_ids": True,
                                             "return_tokens_as_token_ids": True})
    choice = out.choices[0]
    ids = _extra(choice, "token_ids")
    reference = log_softmax(prompt + ids)
    for i, (token, lp, top) in enumerate(zip(ids, choice.logprobs.token_logprobs,
                                             choice.logprobs.top_logprobs, strict=True)):
        row = reference[len(prompt) + i - 1]
        assert lp == pytest.approx(row[token], abs=1e-5)  # the engine's own logprob
        best = np.argsort(-row)[:5]
        assert {f"token_id:{t}" for t in best} | {f"token_id:{token}"} == set(top)
        for t in best:
            assert top[f"token_id:{t}"] == pytest.approx(row[t], abs=1e-5)
    # Chat: top_logprobs in the same order as the reference's ranking.
    chat = oai.chat.completions.create(
        model="served_model", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=20,
        extra_body={"ignore_eos": True, "return_token_ids": True,
                    "return_tokens_as_token_ids": True})
    c = chat.choices[0]
    prompt_ids, ids = _extra(c, "prompt_token_ids"), _extra(c, "token_ids")
    reference = log_softmax(prompt_ids + ids)
    for i, entry in enumerate(c.logprobs.content):
        row = reference[len(prompt_ids) + i - 1]
        assert entry.logprob == pytest.approx(row[ids[i]], abs=1e-5)
        assert [a.token for a in entry.top_logprobs] == [f"token_id:{t}"
                                                         for t in np.argsort(-row)[:20]]
        np.testing.assert_allclose([a.logprob for a in entry.top_logprobs],
                                   np.sort(row)[::-1][:20], atol=1e-5)
    # Streamed: the same alternatives, chunk by chunk.
    streamed = [entry for chunk in oai.chat.completions.create(
        model="served_model", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=20, stream=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content]
    assert [[a.token for a in e.top_logprobs] for e in streamed] == [
        [a.token for a in e.top_logprobs] for e in c.logprobs.content]
    np.testing.assert_allclose([[a.logprob for a in e.top_logprobs] for e in streamed],
                               [[a.logprob for a in e.top_logprobs] for e in c.logprobs.content],
                               atol=1e-5)


def test_echo_prompt_logprobs_equal_a_full_forward(oai: openai.OpenAI, log_softmax,
                                                   tokenizer: Tokenizer):
    """What a log-likelihood harness sends: echo, max_tokens 0, logprobs."""
    text = "The quick brown fox jumps over the lazy dog"
    prompt = tokenizer.encode(text, add_special_tokens=True)
    reference = log_softmax(prompt)
    out = oai.completions.create(model="served_model", prompt=text, max_tokens=0, echo=True,
                                 logprobs=1, temperature=0)
    choice = out.choices[0]
    assert choice.text == text and out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == 0
    lps = choice.logprobs.token_logprobs
    assert lps[0] is None and choice.logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(lps[1:], [reference[i - 1, prompt[i]]
                                         for i in range(1, len(prompt))], atol=1e-5)
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in prompt]
    assert choice.logprobs.text_offset[0] == 0
    # With a continuation: the prompt's log-probs, then the sampled tokens'.
    more = oai.completions.create(model="served_model", prompt=prompt, max_tokens=3,
                                  echo=True, logprobs=0, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    c = more.choices[0]
    ids = _extra(c, "token_ids")
    full = log_softmax(prompt + ids)
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(prompt) + 3
    np.testing.assert_allclose(c.logprobs.token_logprobs[1:],
                               [full[i - 1, t] for i, t in enumerate(prompt + ids) if i],
                               atol=1e-5)


def test_errors_are_openai_json_and_extra_routes(oai: openai.OpenAI, server: str,
                                                client: httpx.Client):
    assert oai.models.retrieve("served_model").id == "served_model"
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("other-model")
    assert info.value.param == "model" and "served_model" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="served_model", messages=[{"role": "user",
                                                                      "content": "hi"}],
                                    response_format={"type": "json_object"})
    assert info.value.param == "response_format"
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405), ("POST", "/health", 405)]:
        response = client.request(method, path)
        assert response.status_code == status, (method, path)
        error = response.json()["error"]
        assert error["code"] == status and error["message"] and "type" in error
    assert httpx.get(f"{server}/version").json() == {"version": nonstop.__version__}
    metrics = httpx.get(f"{server}/metrics").text
    for name in ("nonstop_requests_total", "nonstop_prompt_tokens_total",
                 "nonstop_generation_tokens_total", "nonstop_time_to_first_token_seconds_bucket",
                 "nonstop_inter_token_latency_seconds_bucket", "nonstop_queue_depth",
                 "nonstop_slots_in_use", "nonstop_kv_cache_usage_ratio"):
        assert name in metrics, name
    assert gauge(metrics, "nonstop_slots_total") == MAX_SLOTS
    assert 'nonstop_requests_total{endpoint="/v1/completions",status="200"}' in metrics


def test_200_streaming_clients_some_disconnecting(server: str):
    """Bounded loopback load: every client that stays gets all its tokens; the ones that leave
    free their slots (nothing in use afterwards)."""
    result = asyncio.run(run_load(server, clients=200, max_tokens=8, prompt_len=8,
                                  disconnect_every=4, api_key=API_KEY, timeout_s=300))
    assert len(result.finishers) == 150 and result.complete, [
        r.error for r in result.finishers if r.error][:3]
    assert all(r.chunk_times for r in result.records)  # the leavers left mid-stream
    assert wait_idle(server) == {"nonstop_slots_in_use": 0, "nonstop_requests_running": 0,
                                 "nonstop_queue_depth": 0}
    after = httpx.post(f"{server}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True}, timeout=60)
    assert after.json()["usage"]["completion_tokens"] == 3
