"""`RemoteEngine`'s HTTP wire: its errors, one rollout server as the client knows it, which
failures another attempt (or server) may not meet, and the /v1/completions request it sends and
the Completion it reads back."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from nonstop.engine.sampling import SamplingParams
from nonstop.engine.types import FINISH_REASONS, Completion, RequestError

RETRYABLE_STATUS = (502, 503, 504)
RETRYABLE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                    httpx.ReadError, httpx.WriteError, httpx.PoolTimeout)
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "aborted"}


class RemoteEngineError(RuntimeError):
    """The server failed, could not be reached, or answered with something unusable."""

    def __init__(self, message: str, *, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.status = status
        self.body = body


class RemoteRequestError(RemoteEngineError, RequestError):
    """The server refused the request (HTTP 4xx): the request is at fault, retrying won't help."""


class Unreachable(Exception):
    """One attempt on one server failed in a way another attempt (or server) may not."""


def api_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


def error_message(response: httpx.Response) -> tuple[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500], response.text
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"]), body
    if isinstance(body, dict) and "message" in body:  # some servers use a flat body
        return str(body["message"]), body
    return str(body)[:500], body


@dataclasses.dataclass(eq=False)
class Server:
    """One server as this client knows it."""

    api: str  # ".../v1"
    root: str  # the server's root, where nonstop serve's /nonstop routes live
    up: bool = True
    down_since: float = 0.0  # time.monotonic() when last marked down
    probed: bool = False  # its kind, limits and version are known (reset when it goes down)
    nonstop: bool = False  # a nonstop serve (sessions, weights, versions)
    model: str | None = None
    max_slots: int = 1
    max_len: int | None = None
    version: int | None = None  # the weights' version it runs, as last known
    vllm: bool = False  # a vLLM server with its dev endpoints (VLLM_SERVER_DEV_MODE=1)
    updates: int = 0  # weight updates begun on it (a vLLM request that spans one was aborted)
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)  # not updating
    in_flight: int = 0
    picks: int = 0  # requests sent to it (ties go to the least used)
    # asyncio primitives belong to one event loop: made anew for each loop (`loop`).
    loop: asyncio.AbstractEventLoop | None = None
    lock: asyncio.Lock | None = None  # one probe at a time
    slots: asyncio.Semaphore | None = None  # a nonstop server's slots, as this client holds them

    def on_this_loop(self) -> None:
        """Make the asyncio primitives anew when the running loop is not the one they were
        made on."""
        loop = asyncio.get_running_loop()
        if self.loop is not loop:
            self.loop, self.lock, self.slots = loop, asyncio.Lock(), None

    def __post_init__(self) -> None:
        self.ready.set()

    @property
    def loopback(self) -> bool:
        return urlsplit(self.root).hostname in _LOOPBACK


def completion_request(model: str, token_ids: Sequence[int], params: SamplingParams
                       ) -> dict[str, Any]:
    """The /v1/completions JSON `RemoteEngine` sends for one generation."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": [int(t) for t in token_ids],
        "max_tokens": params.max_tokens,  # null: until a stop or the context's end
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "stop_token_ids": [int(t) for t in params.stop_token_ids],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "n": 1,
        "stream": False,
    }
    if params.stop:
        body["stop"] = list(params.stop)
    if params.seed is not None:
        body["seed"] = params.seed
    return body


def parse_completion(response: Any, server: Server, version: int) -> Completion:
    """A /v1/completions response as a Completion; `version` tags its tokens where the server
    reports no versions (a server that does has its known version raised to them)."""
    try:
        choice = response["choices"][0]
        logprobs = choice.get("logprobs") or {}
        tokens = sampled_ids(choice, logprobs)
        token_logprobs = [float(x) for x in logprobs.get("token_logprobs") or []]
        finish = choice.get("engine_finish_reason") or _FINISH_REASONS.get(
            choice.get("finish_reason"), "stop")
        versions = choice.get("policy_versions")
        stop_reason = choice.get("stop_reason")
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise RemoteEngineError(f"malformed completion response: {error!r}",
                                body=response) from error
    if len(token_logprobs) != len(tokens):
        raise RemoteEngineError(
            f"the server returned {len(tokens)} token ids but {len(token_logprobs)} logprobs; "
            f"it must honour logprobs=0", body=response)
    if versions is None:
        versions = [version] * len(tokens)
    elif len(versions) != len(tokens):
        raise RemoteEngineError(f"policy_versions has {len(versions)} entries for "
                                f"{len(tokens)} tokens", body=response)
    elif versions:
        server.version = max(server.version or 0, max(int(v) for v in versions))
    if finish not in FINISH_REASONS:
        raise RemoteEngineError(f"unknown finish reason {finish!r}", body=response)
    return Completion(tokens=tokens, logprobs=token_logprobs, finish_reason=finish,
                      policy_versions=versions,
                      stop_reason=stop_reason if isinstance(stop_reason, int | str) else None)


def sampled_ids(choice: dict[str, Any], logprobs: dict[str, Any]) -> list[int]:
    if isinstance(choice.get("token_ids"), list):
        return [int(t) for t in choice["token_ids"]]
    tokens = logprobs.get("tokens") or []
    ids = []
    for token in tokens:
        if not (isinstance(token, str) and token.startswith("token_id:")):
            raise RemoteEngineError(
                "the server returned neither choices[].token_ids nor logprobs tokens spelled "
                "'token_id:{id}'; it must support vLLM's return_token_ids or "
                f"return_tokens_as_token_ids (got token {token!r})", body=choice)
        ids.append(int(token.removeprefix("token_id:")))
    return ids


def joined(parts: list[Completion], finish: str) -> Completion:
    """One completion of a request's parts (each a continuation of the ones before)."""
    last = parts[-1]
    return Completion(tokens=[t for p in parts for t in p.tokens],
                      logprobs=[x for p in parts for x in p.logprobs],
                      policy_versions=[v for p in parts for v in p.policy_versions],
                      finish_reason=finish, stop_reason=last.stop_reason)
