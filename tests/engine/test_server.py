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
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from nonstop.engine import openai_protocol as wire
from nonstop.engine.server import ServerConfig, text_deltas
from nonstop.models import ModelConfig
from nonstop.models.chat import ChatTemplate
from nonstop.models.hf_weights import weight_specs
from nonstop.models.tokenizer import Tokenizer
from nonstop.models.validation import ConfigError
from tests.models.tokenizer_fixtures import build_tiny_tokenizer

VOCAB = 293  # prime; the tiny llama3 tokenizer is trained to exactly this many ids
MAX_LEN = 127
MAX_SLOTS = 3
API_KEY = "test-key-7f3a"
STARTUP_TIMEOUT_S = 240.0


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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def start_server(model_dir: Path, log_path: Path, *, api_key: str | None = API_KEY) -> Iterator[str]:
    """Run `nonstop serve` in a subprocess on a free loopback port; yield its base URL once
    /health answers; terminate it (kill if it lingers) on exit, whatever happened."""
    port = _free_port()
    command = [sys.executable, "-m", "nonstop.cli.serve", str(model_dir), "--host", "127.0.0.1",
               "--port", str(port), "--max-len", str(MAX_LEN), "--max-slots", str(MAX_SLOTS),
               "--log-level", "warning"]
    if api_key is not None:
        command += ["--api-key", api_key]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env.pop("NONSTOP_API_KEY", None)
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"server exited with {process.returncode}:\n"
                                       f"{log_path.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n"
                                       f"{log_path.read_text()[-3000:]}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                        break
                time.sleep(0.25)
            yield base_url
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("served_model", numbered=False))


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with start_server(checkpoint, tmp_path_factory.mktemp("log") / "server.log") as url:
        yield url


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


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": list(range(1, MAX_LEN + 5)), "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [5, VOCAB], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [5, -1], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [5], "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": [5], "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": [5], "top_k": -7}, "top_k"),
    ("/v1/completions", {"prompt": [5], "stop_token_ids": [VOCAB + 3]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [5], "logprobs": 3}, "logprobs"),
    ("/v1/completions", b'{"prompt": [5], "max_tokens": ', None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
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
        ({"max_slots": 0}, r"^ServerConfig\.max_slots=0 is invalid; expected an int >= 1$"),
        ({"max_len": 1}, r"^ServerConfig\.max_len=1 is invalid; expected an int >= 2 "),
        ({"dtype": "float16"},
         r"^ServerConfig\.dtype='float16' is invalid; expected one of 'float32', 'bfloat16'$"),
        ({"api_key": ""}, r"^ServerConfig\.api_key='' is invalid; expected None "),
    ],
)
def test_server_config_errors_name_field_value_and_valid_range(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ServerConfig(model_dir="ckpt", **kwargs)
