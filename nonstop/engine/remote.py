"""RemoteEngine: the local Engine's `generate` interface over an OpenAI-compatible HTTP server, so
that `nonstop serve`, vLLM or SGLang servers can do the rollouts.

Each `generate(token_ids, params)` is one POST to `{base_url}/v1/completions` with a token-id
prompt (never re-tokenized) and vLLM's extensions: `ignore_eos: true` with `stop_token_ids`, so
the server stops exactly where the local engine would (put the checkpoint's end-of-sequence ids
in `params.stop_token_ids`); `logprobs: 0`; `return_token_ids` and `return_tokens_as_token_ids`,
so the sampled ids are read from whichever the server returns (neither is an error, never a
guess from text); `skip_special_tokens: false`, so stop strings see the same text as locally.

The completion's `policy_versions` come from the server when it reports them (`nonstop serve`
does), else from the constant `policy_version`; its finish reason from `engine_finish_reason`
when present, else from the OpenAI one ("length" cannot tell `max_tokens` from a full context).
Sessions are handles only (vLLM's and SGLang's prefix caches give the same saving; a closed
one is refused, as locally). It is a `protocol.RolloutClient` (what the agent, the orchestrator
and the evaluator need): `config.max_len` is the `max_len=` given (the server's context),
`stats()` counts what this client sent and received, and the intervals with requests in flight
are recorded as `perf.ENGINE` busy time. It is not yet a `RolloutEngine`: nonstop serve has no
weight-update endpoint, so the learners cannot publish weights to it.

Connection failures and 502/503/504 are retried with exponential backoff; a 4xx raises
`RemoteRequestError` (also an engine `RequestError`) with the server's message, a 5xx or a
malformed response `RemoteEngineError`. docs/engine.md has an example.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx

from nonstop import perf
from nonstop.engine.sampling import SamplingParams
from nonstop.engine.types import FINISH_REASONS, Completion, EngineError, RequestError

log = logging.getLogger(__name__)

_RETRYABLE_STATUS = (502, 503, 504)
_RETRYABLE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                     httpx.ReadError, httpx.WriteError, httpx.PoolTimeout)
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "aborted"}


class RemoteEngineError(RuntimeError):
    """The server failed, could not be reached, or answered with something unusable."""

    def __init__(self, message: str, *, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.status = status
        self.body = body


class RemoteRequestError(RemoteEngineError, RequestError):
    """The server refused the request (HTTP 4xx): the request is at fault, retrying won't help."""


def _api_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


def _error_message(response: httpx.Response) -> tuple[str, Any]:
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


def _sampled_ids(choice: dict[str, Any], logprobs: dict[str, Any]) -> list[int]:
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteLimits:
    """`RemoteEngine.config`: the server's context per request and its concurrency (as given
    to the client; None where not given)."""

    max_len_given: int | None
    max_slots: int = 1

    @property
    def max_len(self) -> int:
        if self.max_len_given is None:
            raise EngineError("RemoteEngine.config.max_len: unknown; pass max_len= (the "
                              "server's context, /v1/models max_model_len) to RemoteEngine")
        return self.max_len_given


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteStats:
    """What this client sent and received since it was made (not the server's counters)."""

    generated_tokens: int
    completed: int
    failed: int
    waiting: int  # always 0: requests queue on the server
    active_slots: int  # requests in flight from this client
    cached_tokens: int  # not reported by the server: 0
    prefix_hit_tokens: int  # not reported by the server: 0
    policy_version: int


class RemoteSession:
    """A multi-turn episode's handle; the server's prefix cache makes later turns cheap."""

    def __init__(self, session_id: int) -> None:
        self.id = session_id
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteEngine:
    """`await generate(token_ids, params)` against an OpenAI-compatible completions server."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 600.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        policy_version: int = 0,
        transport: httpx.AsyncBaseTransport | None = None,
        max_len: int | None = None,
        max_slots: int = 1,
    ):
        """`model`: the served model's name, or None to ask the server's /v1/models once.
        `timeout`: seconds for one HTTP request (a whole generation). `max_retries`: further
        attempts after a connection error or a 502/503/504. `policy_version`: reported for every
        token when the server does not report versions itself. `max_len`, `max_slots`: the
        server's context per request and concurrency, reported as `config` (the agent reads
        `config.max_len`)."""
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {retry_backoff_s}")
        self.base_url = _api_root(base_url)
        self.model = model
        self.policy_version = policy_version
        self._max_retries = max_retries
        self._backoff = retry_backoff_s
        self.config = RemoteLimits(max_len_given=max_len, max_slots=max_slots)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout)
        self._transport = transport
        # One HTTP client per event loop: callers may run several `asyncio.run`s in turn.
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._model_locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}
        self._session_ids = itertools.count()
        self._counts = dict(generated_tokens=0, completed=0, failed=0)
        self._in_flight = 0
        self._busy_since = 0

    @property
    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            for old in [lp for lp in self._clients if lp.is_closed()]:
                self._clients.pop(old)
                self._model_locks.pop(old, None)
            client = httpx.AsyncClient(base_url=self.base_url, headers=self._headers,
                                       timeout=self._timeout, transport=self._transport)
            self._clients[loop] = client
        return client

    async def __aenter__(self) -> RemoteEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        client = self._clients.pop(loop, None)
        if client is not None:
            await client.aclose()
        self.close()

    def close(self) -> None:
        """Close the HTTP clients of loops that have ended (a running loop's client is closed
        by `aclose`, or when its loop ends)."""
        for loop in list(self._clients):
            if not loop.is_running():
                client = self._clients.pop(loop)
                with contextlib.suppress(Exception):
                    asyncio.run(client.aclose())

    def session(self) -> RemoteSession:
        """A session handle (see the module docstring)."""
        return RemoteSession(next(self._session_ids))

    def stats(self) -> RemoteStats:
        return RemoteStats(generated_tokens=self._counts["generated_tokens"],
                           completed=self._counts["completed"], failed=self._counts["failed"],
                           waiting=0, active_slots=self._in_flight, cached_tokens=0,
                           prefix_hit_tokens=0, policy_version=self.policy_version)

    # ---------------------------------------------------------------- HTTP

    async def _request(self, method: str, path: str, json: dict[str, Any] | None = None) -> Any:
        for attempt in range(self._max_retries + 1):
            last = attempt == self._max_retries
            try:
                response = await self._client.request(method, path, json=json)
            except _RETRYABLE_ERRORS as error:
                if last:
                    raise RemoteEngineError(
                        f"{method} {self.base_url}{path} failed after {attempt + 1} attempts: "
                        f"{type(error).__name__}: {error}") from error
                log.warning("%s %s: %s; retrying", method, path, error)
            else:
                if response.status_code < 400:
                    try:
                        return response.json()
                    except ValueError as error:
                        raise RemoteEngineError(f"{method} {path}: the response is not JSON: "
                                                f"{response.text[:200]!r}") from error
                message, body = _error_message(response)
                text = f"{method} {self.base_url}{path} -> HTTP {response.status_code}: {message}"
                if 400 <= response.status_code < 500:
                    raise RemoteRequestError(text, status=response.status_code, body=body)
                if response.status_code not in _RETRYABLE_STATUS or last:
                    raise RemoteEngineError(text, status=response.status_code, body=body)
                log.warning("%s; retrying", text)
            await asyncio.sleep(self._backoff * 2**attempt)
        raise AssertionError("unreachable")

    async def models(self) -> list[str]:
        """Ids of the models the server serves."""
        body = await self._request("GET", "/models")
        return [entry["id"] for entry in body.get("data", [])]

    async def _model_name(self) -> str:
        lock = self._model_locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
        async with lock:
            if self.model is None:
                names = await self.models()
                if not names:
                    raise RemoteEngineError(f"{self.base_url}/models lists no model")
                self.model = names[0]
        return self.model

    # ---------------------------------------------------------------- generate

    def request_body(self, model: str, token_ids: Sequence[int], params: SamplingParams
                     ) -> dict[str, Any]:
        """The /v1/completions JSON this engine sends for one generation."""
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

    async def generate(self, token_ids: Sequence[int], params: SamplingParams | None = None,
                       session: RemoteSession | None = None) -> Completion:
        """Sample a continuation of `token_ids` (`session`: see the module docstring).
        Cancelling the awaiting task closes the HTTP request; the server then frees it."""
        if session is not None and session.closed:
            raise RequestError(f"session: session {session.id} is closed")
        params = params or SamplingParams()
        body = self.request_body(await self._model_name(), token_ids, params)
        if self._in_flight == 0:
            self._busy_since = time.perf_counter_ns()
        self._in_flight += 1
        try:
            completion = await self._completion(body)
        except BaseException:
            self._counts["failed"] += 1
            raise
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                perf.device_busy_interval(perf.ENGINE, self._busy_since, time.perf_counter_ns())
        self._counts["completed"] += 1
        self._counts["generated_tokens"] += len(completion.tokens)
        return completion

    async def _completion(self, body: dict[str, Any]) -> Completion:
        response = await self._request("POST", "/completions", json=body)
        try:
            choice = response["choices"][0]
            logprobs = choice.get("logprobs") or {}
            tokens = _sampled_ids(choice, logprobs)
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
            versions = [self.policy_version] * len(tokens)
        elif len(versions) != len(tokens):
            raise RemoteEngineError(f"policy_versions has {len(versions)} entries for "
                                    f"{len(tokens)} tokens", body=response)
        if finish not in FINISH_REASONS:
            raise RemoteEngineError(f"unknown finish reason {finish!r}", body=response)
        return Completion(tokens=tokens, logprobs=token_logprobs, finish_reason=finish,
                          policy_versions=versions,
                          stop_reason=stop_reason if isinstance(stop_reason, int | str) else None)
