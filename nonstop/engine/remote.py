"""RemoteEngine: the rollout protocol over HTTP, so that `nonstop serve` processes (on this host or
others) do a trainer's rollouts, or vLLM and SGLang servers do its generation.

    with RemoteEngine(["http://10.0.0.5:8000", "http://10.0.0.6:8000"], policy=model,
                      max_len=512) as engine:
        completion = await engine.generate(token_ids, params, session=session)
        engine.update_weights(nnx.state(model, nnx.Param), version)   # every server

Each `generate(token_ids, params)` is one POST to a server's `/v1/completions` with a token-id
prompt (never re-tokenized) and vLLM's extensions: `ignore_eos: true` with `stop_token_ids`, so
the server stops exactly where the local engine would (put the checkpoint's end-of-sequence ids
in `params.stop_token_ids`); `logprobs: 0`; `return_token_ids` and `return_tokens_as_token_ids`,
so the sampled ids are read from whichever the server returns (neither is an error, never a
guess from text); `skip_special_tokens: false`, so stop strings see the same text as locally.
The completion's `policy_versions` come from the server when it reports them (`nonstop serve`
does), else from this client's `policy_version`.

Several servers: a request goes to the live server with the fewest requests in flight per slot
(ties: the one sent the fewest so far);
every turn of a session goes to the server its first turn went to (session affinity: `nonstop
serve` keeps the session's KV cache between turns; other servers' prefix caches do the same).
A server that cannot be reached (or answers 502/503/504) is marked down and the request is sent
to another one with the same seed, so the episode goes on (`stats().rerouted` counts them); a
down server is probed again after `revive_after_s`; with no server left the client waits
`retry_backoff_s * 2**k` and tries the down ones again, up to `max_retries` further attempts.

Weights: `update_weights(params, version)` encodes the policy's parameters once
(`weight_transfer.encode_weights`: Hugging Face names and layouts, LoRA merged, cast to
`weight_dtype`) and hands the blob to every live server; it returns once every live server has
taken them (requests submitted afterwards sample from them). A `nonstop serve` gets it posted,
through POSIX shared memory when every server is on this host (`weight_transfer="auto"`), else
as the request body. A vLLM server started with `VLLM_SERVER_DEV_MODE=1` (it has no in-memory
transfer on CPU) reloads it from a file: the blob is written once per update as
`model.safetensors` in `weight_dir`, then the server is paused (`POST /pause?mode=abort`), reloads
(`POST /collective_rpc` `reload_weights`), takes the version (`/update_weight_version`) and
resumes. Its requests in flight end "abort" with their tokens so far; this client resubmits
each with that prefix appended to the prompt (remaining `max_tokens`, same seed), so the
prefix keeps the old version and the rest is sampled from the new weights, as `VLLMEngine`
does in-process (`stats().restarted` counts them; a stop string spanning the seam is not
seen). Other servers (SGLang, vLLM without dev mode) are generation-only: updating them is an
error. The last blob is kept: a server seen for the first time, or back after being down, gets
it before its first request whenever its version differs (a server that joins late, or
restarts, never samples with stale weights). `policy=` (the trainer's model, for its
architecture) is needed for this; without it the engine is generation-only.

Connection failures and 502/503/504 are retried as above; a 4xx raises `RemoteRequestError`
(also an engine `RequestError`) with the server's message, a 5xx or a malformed response
`RemoteEngineError`. Busy time is the union of the intervals with requests in flight, recorded
as `perf.ENGINE`. docs/engine.md has an example.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
import numpy as np
from flax import nnx

from nonstop import perf
from nonstop.engine.sampling import SamplingParams
from nonstop.engine.types import FINISH_REASONS, Completion, EngineError, RequestError
from nonstop.engine.weight_transfer import encode_weights

log = logging.getLogger(__name__)

_RETRYABLE_STATUS = (502, 503, 504)
_RETRYABLE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                     httpx.ReadError, httpx.WriteError, httpx.PoolTimeout)
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "aborted"}
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
WeightTransfer = Literal["auto", "http", "shm"]


class RemoteEngineError(RuntimeError):
    """The server failed, could not be reached, or answered with something unusable."""

    def __init__(self, message: str, *, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.status = status
        self.body = body


class RemoteRequestError(RemoteEngineError, RequestError):
    """The server refused the request (HTTP 4xx): the request is at fault, retrying won't help."""


class _Unreachable(Exception):
    """One attempt on one server failed in a way another attempt (or server) may not."""


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
    """`RemoteEngine.config`: the context per request and the concurrency of all servers (as
    given, else as the servers report once reached)."""

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
    """What this client sent and received since it was made (not the servers' counters)."""

    generated_tokens: int
    completed: int
    failed: int
    waiting: int  # always 0: requests queue on the servers
    active_slots: int  # requests in flight from this client
    cached_tokens: int  # not reported by the servers: 0
    prefix_hit_tokens: int  # not reported by the servers: 0
    policy_version: int
    rerouted: int  # requests sent again to another server after theirs failed
    server_failures: int  # times a server was marked down
    servers_up: int
    weight_updates: int
    weight_sync_s: float  # seconds spent in update_weights and late-join pushes
    restarted: int  # requests a vLLM server aborted for weights, resubmitted with their prefix


@dataclasses.dataclass(eq=False)
class _Server:
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
    lock: asyncio.Lock | None = None

    def __post_init__(self) -> None:
        self.ready.set()

    @property
    def loopback(self) -> bool:
        return urlsplit(self.root).hostname in _LOOPBACK


class RemoteSession:
    """A multi-turn episode's handle: its turns go to one server, which keeps its KV cache."""

    def __init__(self, engine: RemoteEngine | None, session_id: int) -> None:
        self.id = session_id
        self.closed = False
        self._engine = engine

    def close(self) -> None:
        if not self.closed and self._engine is not None:
            self._engine._forget(self)
        self.closed = True

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteEngine:
    """The rollout protocol against one or several OpenAI-compatible completions servers."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 600.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        policy_version: int = 0,
        transport: httpx.AsyncBaseTransport | None = None,
        max_len: int | None = None,
        max_slots: int | None = None,
        policy: nnx.Module | None = None,
        weight_dtype: str = "float32",
        weight_transfer: WeightTransfer = "auto",
        revive_after_s: float = 5.0,
        weight_dir: str | os.PathLike[str] | None = None,
    ):
        """`base_url`: one server's URL or a list of them. `model`: the served model's name, or
        None to ask each server. `timeout`: seconds for one HTTP request (a whole generation).
        `max_retries`: further attempts after a connection error or a 502/503/504 (beyond one
        try on each other server). `policy_version`: reported for every token when a server
        does not report versions. `max_len`, `max_slots`: the context per request and the
        concurrency, reported as `config` (None: from the servers, once reached). `policy`:
        the trainer's model, whose architecture `update_weights` encodes for; `weight_dtype`:
        the dtype weights travel in; `weight_transfer`: "auto" (shared memory when every
        server is on this host), "http" or "shm". `revive_after_s`: how long a server that
        failed is left alone before it is probed again (and brought up to date). `weight_dir`:
        where updates for vLLM servers are written (`model.safetensors`, replaced each update);
        the servers must read it at the same path (same host, or a shared filesystem). None: a
        temporary directory of this process, removed by `close` (same host only)."""
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("RemoteEngine needs at least one server URL")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {retry_backoff_s}")
        if weight_transfer not in ("auto", "http", "shm"):
            raise ValueError(f"weight_transfer must be 'auto', 'http' or 'shm', got "
                             f"{weight_transfer!r}")
        self._servers = [_Server(api=_api_root(u), root=_api_root(u).removesuffix("/v1"))
                         for u in urls]
        self.base_url = self._servers[0].api
        self.model = model
        self.policy_version = policy_version
        self._max_retries = max_retries
        self._backoff = retry_backoff_s
        self._revive_after = revive_after_s
        self._max_slots_given = max_slots
        self.config = RemoteLimits(max_len_given=max_len, max_slots=max_slots or len(urls))
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout)
        self._transport = transport
        # One HTTP client per event loop: callers may run several `asyncio.run`s in turn.
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._client_id = uuid.uuid4().hex[:12]
        self._session_ids = itertools.count()
        self._pinned: dict[int, _Server] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._counts = dict(generated_tokens=0, completed=0, failed=0, rerouted=0,
                            server_failures=0, weight_updates=0, restarted=0)
        self._sync_s = 0.0
        self._in_flight = 0
        self._busy_since = 0
        self._weight_dtype = np.dtype(weight_dtype)
        self._transfer = weight_transfer
        self._graphdef = self._rest = None
        if policy is not None:
            self._graphdef, _, self._rest = nnx.split(policy, nnx.Param, ...)
        self._blob: bytes | None = None  # the last weights published, for late joiners
        self._blob_version = policy_version
        self._weight_dir = None if weight_dir is None else os.fspath(weight_dir)
        self._own_weight_dir: str | None = None  # the temporary one, removed by close()
        self._written_version: int | None = None  # the version in weight_dir's file
        self._file_lock = threading.Lock()

    # ---------------------------------------------------------------- lifecycle

    @property
    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            for old in [lp for lp in self._clients if lp.is_closed()]:
                self._clients.pop(old)
            client = httpx.AsyncClient(headers=self._headers, timeout=self._timeout,
                                       transport=self._transport)
            self._clients[loop] = client
            for server in self._servers:  # asyncio locks belong to one loop
                server.lock = None
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
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        loop = asyncio.get_running_loop()
        client = self._clients.pop(loop, None)
        if client is not None:
            await client.aclose()
        self.close()

    def close(self) -> None:
        """Close the HTTP clients of loops that have ended (a running loop's client is closed
        by `aclose`, or when its loop ends); remove the temporary weight directory."""
        if self._own_weight_dir is not None:
            shutil.rmtree(self._own_weight_dir, ignore_errors=True)
            self._own_weight_dir = self._written_version = None
        for loop in list(self._clients):
            if not loop.is_running():
                client = self._clients.pop(loop)
                with contextlib.suppress(Exception):
                    asyncio.run(client.aclose())

    def session(self) -> RemoteSession:
        """A session handle: its turns go to one server (see the module docstring)."""
        return RemoteSession(self, next(self._session_ids))

    def _forget(self, session: RemoteSession) -> None:
        """Unpin a closing session and, from inside an event loop, close it on its server (a
        server also closes idle sessions by itself)."""
        server = self._pinned.pop(session.id, None)
        if server is None or not server.nonstop or not server.up:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if loop in self._clients:
            task = loop.create_task(self._close_session(server, self._session_key(session)))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _close_session(self, server: _Server, key: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self._client.delete(f"{server.root}/nonstop/sessions/{key}")

    def _session_key(self, session: RemoteSession) -> str:
        return f"{self._client_id}-{session.id}"

    def stats(self) -> RemoteStats:
        c = self._counts
        return RemoteStats(generated_tokens=c["generated_tokens"], completed=c["completed"],
                           failed=c["failed"], waiting=0, active_slots=self._in_flight,
                           cached_tokens=0, prefix_hit_tokens=0,
                           policy_version=self.policy_version, rerouted=c["rerouted"],
                           server_failures=c["server_failures"],
                           servers_up=sum(s.up for s in self._servers),
                           weight_updates=c["weight_updates"], weight_sync_s=self._sync_s,
                           restarted=c["restarted"])

    # ---------------------------------------------------------------- HTTP

    async def _once(self, server: _Server, method: str, path: str,
                    json: dict[str, Any] | None = None) -> Any:
        """One attempt; `_Unreachable` where another attempt may succeed."""
        url = f"{server.api}{path}"
        try:
            response = await self._client.request(method, url, json=json)
        except _RETRYABLE_ERRORS as error:
            raise _Unreachable(f"{method} {url}: {type(error).__name__}: {error}") from error
        if response.status_code < 400:
            try:
                return response.json()
            except ValueError as error:
                raise RemoteEngineError(f"{method} {url}: the response is not JSON: "
                                        f"{response.text[:200]!r}") from error
        message, body = _error_message(response)
        text = f"{method} {url} -> HTTP {response.status_code}: {message}"
        if response.status_code in _RETRYABLE_STATUS:
            raise _Unreachable(text)
        if 400 <= response.status_code < 500:
            raise RemoteRequestError(text, status=response.status_code, body=body)
        raise RemoteEngineError(text, status=response.status_code, body=body)

    async def models(self) -> list[str]:
        """Ids of the models the first server serves."""
        body = await self._once(self._servers[0], "GET", "/models")
        return [entry["id"] for entry in body.get("data", [])]

    def _mark_down(self, server: _Server, why: str) -> None:
        if server.up:
            log.warning("rollout server %s is down (%s); using the others", server.root, why)
            self._counts["server_failures"] += 1
        server.up = False
        server.down_since = time.monotonic()
        server.probed = False
        for sid in [sid for sid, s in list(self._pinned.items()) if s is server]:
            self._pinned.pop(sid)  # its sessions move with their next turn

    async def _probe(self, server: _Server) -> None:
        """Learn the server's kind, limits and version; bring a nonstop server's weights up to
        date (a late joiner, or one back after a restart). `_Unreachable` if it does not
        answer."""
        if server.lock is None:
            server.lock = asyncio.Lock()
        async with server.lock:
            if server.probed:
                return
            try:
                response = await self._client.get(f"{server.root}/nonstop/state")
            except _RETRYABLE_ERRORS as error:
                raise _Unreachable(f"GET {server.root}/nonstop/state: {error}") from error
            if response.status_code in _RETRYABLE_STATUS:
                raise _Unreachable(f"GET {server.root}/nonstop/state -> {response.status_code}")
            if response.status_code == 200:
                state = response.json()
                server.nonstop = True
                server.model = state.get("model")
                server.max_slots = int(state.get("max_slots", 1))
                server.max_len = state.get("max_len")
                server.version = int(state.get("policy_version", 0))
            elif response.status_code in (401, 403):
                message, body = _error_message(response)
                raise RemoteRequestError(f"{server.root}: {message}", status=response.status_code,
                                         body=body)
            else:  # vLLM (weights through its dev endpoints, if on), SGLang: generation only
                server.nonstop = False
                await self._probe_vllm(server)
            given = self.config.max_len_given
            if server.max_len is not None and given is not None and server.max_len < given:
                raise EngineError(
                    f"rollout server {server.root} serves a context of {server.max_len} tokens, "
                    f"less than the {given} this run needs (engine.max_len): start it with "
                    f"--max-len {given} or lower engine.max_len")
            if ((server.nonstop or server.vllm) and self._blob is not None
                    and server.version != self._blob_version):
                started = time.perf_counter()
                await asyncio.to_thread(self._push_one, server, self._blob, self._blob_version)
                self._sync_s += time.perf_counter() - started
            server.probed = True
            if self._max_slots_given is None:
                slots = sum(s.max_slots for s in self._servers)
                self.config = dataclasses.replace(self.config, max_slots=slots)

    async def _probe_vllm(self, server: _Server) -> None:
        """Whether `server` has vLLM's dev endpoints (GET /is_paused answers), and the weight
        version it reports (an int this client set, else unknown: "default" after a start)."""
        try:
            paused = await self._client.get(f"{server.root}/is_paused")
            if paused.status_code != 200:
                server.vllm = False
                return
            info = await self._client.get(f"{server.root}/weight_info")
        except _RETRYABLE_ERRORS as error:
            raise _Unreachable(f"GET {server.root}/is_paused: {error}") from error
        server.vllm, server.version = True, None
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            server.version = int(info.json().get("weight_version"))

    async def _pick(self, session: RemoteSession | None) -> _Server:
        """The server for the next attempt, probed and with this request counted in its
        `in_flight` (the caller releases it), or `_Unreachable` when none is up."""
        if session is not None:
            pinned = self._pinned.get(session.id)
            if pinned is not None and pinned.up:
                pinned.in_flight += 1
                return pinned
        now = time.monotonic()
        for s in self._servers:  # a server down a while gets another chance (re-probed)
            if not s.up and now - s.down_since >= self._revive_after:
                s.up = True
        live = [s for s in self._servers if s.up]
        if not live:
            raise _Unreachable("no rollout server is up")
        server = min(live, key=lambda s: (s.in_flight / max(s.max_slots, 1), s.in_flight,
                                          s.picks))
        server.in_flight += 1
        server.picks += 1  # counted while it is probed, so others spread meanwhile
        if not server.probed:
            try:
                await self._probe(server)
            except BaseException as error:
                server.in_flight -= 1
                if isinstance(error, _Unreachable):
                    self._mark_down(server, str(error))
                raise
        if session is not None:
            self._pinned[session.id] = server
        return server

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

    async def _model_name(self, server: _Server) -> str:
        if self.model is not None:
            return self.model
        if server.model is None:
            body = await self._once(server, "GET", "/models")
            names = [entry["id"] for entry in body.get("data", [])]
            if not names:
                raise RemoteEngineError(f"{server.api}/models lists no model")
            server.model = names[0]
        return server.model

    async def generate(self, token_ids: Sequence[int], params: SamplingParams | None = None,
                       session: RemoteSession | None = None) -> Completion:
        """Sample a continuation of `token_ids` (`session`: see the module docstring).
        Cancelling the awaiting task closes the HTTP request; the server then frees it."""
        if session is not None and session.closed:
            raise RequestError(f"session: session {session.id} is closed")
        params = params or SamplingParams()
        if self._in_flight == 0:
            self._busy_since = time.perf_counter_ns()
        self._in_flight += 1
        try:
            completion = await self._with_failover(token_ids, params, session)
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

    async def _with_failover(self, token_ids: Sequence[int], params: SamplingParams,
                             session: RemoteSession | None) -> Completion:
        budget = self._max_retries + len(self._servers) - 1
        failures, waits = 0, 0
        done: list[Completion] = []  # parts a vLLM weight update aborted, in order
        while True:
            server = None
            try:
                server = await self._pick(session)
                try:
                    while not server.ready.is_set():  # an update from another thread is on
                        await asyncio.sleep(0.005)
                    updates = server.updates
                    version = self._version_of(server) if server.vllm else None
                    prompt, part_params = token_ids, params
                    if done:
                        prompt, part_params = self._resume_from(token_ids, params, done)
                        if part_params is None:
                            return _joined(done, "length")
                    body = self.request_body(await self._model_name(server), prompt,
                                             part_params)
                    if session is not None and server.nonstop:
                        body["session_id"] = self._session_key(session)
                    response = await self._once(server, "POST", "/completions", json=body)
                finally:
                    server.in_flight -= 1
                part = self._completion(response, server, version)
                if (part.finish_reason == "aborted" and server.vllm
                        and (server.updates != updates or not server.ready.is_set())):
                    done.append(part)  # aborted by our weight update: go on from its tokens
                    self._counts["restarted"] += 1
                    continue
                return _joined([*done, part], part.finish_reason) if done else part
            except _Unreachable as error:
                if server is not None and server.up:
                    self._mark_down(server, str(error))
                failures += 1
                if failures > budget:
                    raise RemoteEngineError(
                        f"POST /completions failed after {failures} attempts: {error}") from error
                if server is not None:
                    self._counts["rerouted"] += 1
                if not any(s.up for s in self._servers):
                    await asyncio.sleep(self._backoff * 2**waits)
                    waits += 1
                    for s in self._servers:  # try the down ones again
                        s.up = True

    def _version_of(self, server: _Server) -> int:
        return server.version if server.version is not None else self.policy_version

    def _resume_from(self, token_ids: Sequence[int], params: SamplingParams,
                     done: list[Completion]) -> tuple[list[int], SamplingParams | None]:
        """The prompt and params that continue a request from the tokens it has (None: its
        `max_tokens` or the context is used up)."""
        prefix = [t for part in done for t in part.tokens]
        prompt = [*token_ids, *prefix]
        room = None if self.config.max_len_given is None else self.config.max_len_given - len(
            prompt)
        budget = None if params.max_tokens is None else params.max_tokens - len(prefix)
        if (budget is not None and budget < 1) or (room is not None and room < 1):
            return prompt, None
        return prompt, dataclasses.replace(params, max_tokens=budget)

    def _completion(self, response: Any, server: _Server,
                    version: int | None = None) -> Completion:
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
            versions = [self.policy_version if version is None else version] * len(tokens)
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

    # ---------------------------------------------------------------- weights

    def update_weights(self, params: nnx.State, version: int) -> None:
        """Publish `params` (the policy's `nnx.Param` state) as `version` to every live
        server; returns once each has taken them (see the module docstring)."""
        if self._graphdef is None:
            raise EngineError("RemoteEngine.update_weights needs the policy's architecture: "
                              "pass policy=<the trainer's model> to RemoteEngine")
        for server in self._servers:
            if server.probed and not (server.nonstop or server.vllm):
                raise _takes_no_weights(server)
        started = time.perf_counter()
        with perf.span("engine/weight_update", policy_version=int(version)):
            blob = encode_weights(self._graphdef, params, self._rest, self._weight_dtype)
            self._blob, self._blob_version = blob, int(version)
            targets = [s for s in self._servers
                       if s.up and (s.nonstop or s.vllm or not s.probed)]
            with concurrent.futures.ThreadPoolExecutor(max(len(targets), 1)) as pool:
                results = list(pool.map(lambda s: self._try_push(s, blob, int(version)),
                                        targets))
        if targets and not any(results):
            raise RemoteEngineError(f"update_weights: no rollout server took version {version}"
                                    " (all are down; see the warnings above)")
        self.policy_version = int(version)
        self._counts["weight_updates"] += 1
        self._sync_s += time.perf_counter() - started

    def _try_push(self, server: _Server, blob: bytes, version: int) -> bool:
        try:
            self._push_one(server, blob, version)
            return True
        except _Unreachable as error:
            self._mark_down(server, str(error))
            return False

    def _push_one(self, server: _Server, blob: bytes, version: int) -> None:
        """Post `blob` to one server (blocking; shared memory for a server on this host when
        `weight_transfer` allows), or have a vLLM server reload it from `weight_dir`. A version
        the server has passed already is not an error."""
        if server.vllm:
            self._reload_vllm(server, blob, version)
            return
        shm = self._transfer == "shm" or (self._transfer == "auto" and server.loopback)
        url = f"{server.root}/nonstop/weights"
        segment = None
        try:
            with httpx.Client(headers=self._headers, timeout=self._timeout) as client:
                if shm:
                    segment = shared_memory.SharedMemory(create=True, size=max(len(blob), 1))
                    segment.buf[:len(blob)] = blob
                    response = client.post(url, json={"version": version, "shm": segment.name,
                                                      "nbytes": len(blob)})
                else:
                    response = client.post(url, params={"version": version}, content=blob,
                                           headers={"Content-Type": "application/octet-stream"})
        except _RETRYABLE_ERRORS as error:
            raise _Unreachable(f"POST {url}: {type(error).__name__}: {error}") from error
        finally:
            if segment is not None:
                segment.close()
                segment.unlink()
        if response.status_code in _RETRYABLE_STATUS:
            raise _Unreachable(f"POST {url} -> HTTP {response.status_code}")
        if response.status_code == 404:  # not nonstop serve: a vLLM server in dev mode?
            if self._has_vllm_dev_endpoints(server):
                server.vllm = True
                self._reload_vllm(server, blob, version)
                return
            raise _takes_no_weights(server)
        if response.status_code == 409:  # it runs a newer version already
            return
        if response.status_code >= 400:
            message, body = _error_message(response)
            raise RemoteEngineError(f"POST {url} -> HTTP {response.status_code}: {message}",
                                    status=response.status_code, body=body)
        server.version = version
        server.nonstop = True

    def _has_vllm_dev_endpoints(self, server: _Server) -> bool:
        url = f"{server.root}/is_paused"
        try:
            with httpx.Client(headers=self._headers, timeout=self._timeout) as client:
                return client.get(url).status_code == 200
        except _RETRYABLE_ERRORS as error:
            raise _Unreachable(f"GET {url}: {type(error).__name__}: {error}") from error

    def _weights_file(self, blob: bytes, version: int) -> str:
        """The directory whose `model.safetensors` holds `blob` (written once per version, and
        atomically: a server never reads half a file)."""
        with self._file_lock:
            if self._weight_dir is None and self._own_weight_dir is None:
                self._own_weight_dir = tempfile.mkdtemp(prefix="nonstop-weights-")
            directory = self._weight_dir or self._own_weight_dir
            assert directory is not None
            if self._written_version != version:
                os.makedirs(directory, exist_ok=True)
                path = os.path.join(directory, "model.safetensors")
                with open(path + ".tmp", "wb") as file:
                    file.write(blob)
                os.replace(path + ".tmp", path)
                self._written_version = version
            return directory

    def _reload_vllm(self, server: _Server, blob: bytes, version: int) -> None:
        """Pause `server` (aborting what runs), reload the weights from `weight_dir`, set the
        version, resume (blocking). New requests from this client wait meanwhile."""
        directory = self._weights_file(blob, version)
        with httpx.Client(headers=self._headers, timeout=self._timeout) as client:
            server.ready.clear()
            server.updates += 1
            try:
                self._vllm_call(client, server, "/pause", params={"mode": "abort"})
                self._vllm_call(client, server, "/collective_rpc", json={
                    "method": "reload_weights", "kwargs": {"weights_path": directory}})
                # A request sent just before the pause may have been queued (not aborted) by it:
                # abort it too, so that every request that spans the reload is resubmitted.
                self._vllm_call(client, server, "/abort_requests", json={})
                self._vllm_call(client, server, "/update_weight_version",
                                json={"new_version": str(version)})
                server.version = version
            finally:
                try:
                    self._vllm_call(client, server, "/resume")
                finally:
                    server.ready.set()

    def _vllm_call(self, client: httpx.Client, server: _Server, path: str,
                   json: dict[str, Any] | None = None,
                   params: dict[str, str] | None = None) -> None:
        url = f"{server.root}{path}"
        try:
            response = client.post(url, json=json, params=params)
        except _RETRYABLE_ERRORS as error:
            raise _Unreachable(f"POST {url}: {type(error).__name__}: {error}") from error
        if response.status_code in _RETRYABLE_STATUS:
            raise _Unreachable(f"POST {url} -> HTTP {response.status_code}")
        if response.status_code == 404:
            raise RemoteEngineError(f"{server.root} has no POST {path} (HTTP 404): start vllm "
                                    "serve with VLLM_SERVER_DEV_MODE=1 to update its weights",
                                    status=404)
        if response.status_code >= 400:
            message, body = _error_message(response)
            hint = (f" (weight_dir {self._weight_dir or self._own_weight_dir!r} must be readable "
                    "by the server at that path)") if path == "/collective_rpc" else ""
            raise RemoteEngineError(f"POST {url} -> HTTP {response.status_code}: {message}{hint}",
                                    status=response.status_code, body=body)


def _takes_no_weights(server: _Server) -> RemoteEngineError:
    return RemoteEngineError(
        f"{server.root} takes no weights: neither nonstop serve's POST /nonstop/weights nor "
        "vLLM's GET /is_paused answers (404); for vLLM, start vllm serve with "
        "VLLM_SERVER_DEV_MODE=1 (its weight-update endpoints), else use nonstop serve")


def _joined(parts: list[Completion], finish: str) -> Completion:
    """One completion of a request's parts (each a continuation of the ones before)."""
    last = parts[-1]
    return Completion(tokens=[t for p in parts for t in p.tokens],
                      logprobs=[x for p in parts for x in p.logprobs],
                      policy_versions=[v for p in parts for v in p.policy_versions],
                      finish_reason=finish, stop_reason=last.stop_reason)


__all__ = ["RemoteEngine", "RemoteEngineError", "RemoteLimits", "RemoteRequestError",
           "RemoteSession", "RemoteStats", "WeightTransfer"]
