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
it before its first request whenever its version is older or unknown (a server that joins
late, or restarts, never samples with stale weights). `policy=` (the trainer's model, for its
architecture) is needed for this; without it the engine is generation-only. A trainer in several
`jax.distributed` processes shares its servers: process 0's engine publishes each update, the
others' (`publish=False`) only keep the weights, encoded if a server is found behind, so every
server takes each version once; the caller holds the processes at a barrier until process 0's
update returns.

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
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx
import jax
import numpy as np
from flax import nnx

from nonstop import perf
from nonstop.engine.remote_http import (
    RETRYABLE_ERRORS,
    RETRYABLE_STATUS,
    RemoteEngineError,
    RemoteRequestError,
    Server,
    Unreachable,
    api_root,
    completion_request,
    error_message,
    joined,
    parse_completion,
)
from nonstop.engine.remote_types import RemoteLimits, RemoteSession, RemoteStats
from nonstop.engine.remote_weights import WeightPusher, WeightTransfer, takes_no_weights
from nonstop.engine.sampling import SamplingParams
from nonstop.engine.types import Completion, EngineError, RequestError
from nonstop.engine.weight_transfer import encode_weights

log = logging.getLogger(__name__)


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
        publish: bool = True,
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
        temporary directory of this process, removed by `close` (same host only). `publish`:
        False where another process's engine hands each update to these servers (see the
        module docstring)."""
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
        self._servers = [Server(api=api_root(u), root=api_root(u).removesuffix("/v1"))
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
        self._pinned: dict[int, Server] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._counts = dict(generated_tokens=0, completed=0, failed=0, rerouted=0,
                            server_failures=0, weight_updates=0, restarted=0)
        self._sync_s = 0.0
        self._in_flight = 0
        self._waiting = 0  # requests waiting here for a slot of their server
        self._sent = 0  # requests sent and not yet answered
        self._busy_since = 0
        self._weight_dtype = np.dtype(weight_dtype)
        self._pusher = WeightPusher(self._headers, self._timeout, weight_transfer, weight_dir)
        self._graphdef = self._rest = None
        if policy is not None:
            self._graphdef, _, self._rest = nnx.split(policy, nnx.Param, ...)
        self._publish = publish
        # The last update, for servers found behind: its blob, or (publish=False) its weights
        # until a server needs them encoded.
        self._blob: bytes | None = None
        self._unencoded: nnx.State | None = None
        self._blob_version = policy_version
        self._blob_lock = threading.Lock()  # updates (a trainer thread) against probes

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
        self._pusher.close()
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

    async def _close_session(self, server: Server, key: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self._client.delete(f"{server.root}/nonstop/sessions/{key}")

    def _session_key(self, session: RemoteSession) -> str:
        return f"{self._client_id}-{session.id}"

    def stats(self) -> RemoteStats:
        c = self._counts
        return RemoteStats(generated_tokens=c["generated_tokens"], completed=c["completed"],
                           failed=c["failed"], waiting=self._waiting, active_slots=self._sent,
                           cached_tokens=0, prefix_hit_tokens=0,
                           policy_version=self.policy_version, rerouted=c["rerouted"],
                           server_failures=c["server_failures"],
                           servers_up=sum(s.up for s in self._servers),
                           weight_updates=c["weight_updates"], weight_sync_s=self._sync_s,
                           restarted=c["restarted"])

    # ---------------------------------------------------------------- HTTP

    async def _once(self, server: Server, method: str, path: str,
                    json: dict[str, Any] | None = None) -> Any:
        """One attempt; `Unreachable` where another attempt may succeed."""
        url = f"{server.api}{path}"
        try:
            response = await self._client.request(method, url, json=json)
        except RETRYABLE_ERRORS as error:
            raise Unreachable(f"{method} {url}: {type(error).__name__}: {error}") from error
        if response.status_code < 400:
            try:
                return response.json()
            except ValueError as error:
                raise RemoteEngineError(f"{method} {url}: the response is not JSON: "
                                        f"{response.text[:200]!r}") from error
        message, body = error_message(response)
        text = f"{method} {url} -> HTTP {response.status_code}: {message}"
        if response.status_code in RETRYABLE_STATUS:
            raise Unreachable(text)
        if 400 <= response.status_code < 500:
            raise RemoteRequestError(text, status=response.status_code, body=body)
        raise RemoteEngineError(text, status=response.status_code, body=body)

    async def models(self) -> list[str]:
        """Ids of the models the first server serves."""
        body = await self._once(self._servers[0], "GET", "/models")
        return [entry["id"] for entry in body.get("data", [])]

    def _mark_down(self, server: Server, why: str) -> None:
        if server.up:
            log.warning("rollout server %s is down (%s); using the others", server.root, why)
            self._counts["server_failures"] += 1
        server.up = False
        server.down_since = time.monotonic()
        server.probed = False
        for sid in [sid for sid, s in list(self._pinned.items()) if s is server]:
            self._pinned.pop(sid)  # its sessions move with their next turn

    async def _probe(self, server: Server) -> None:
        """Learn the server's kind, limits and version; bring a nonstop server's weights up to
        date (a late joiner, or one back after a restart). `Unreachable` if it does not
        answer."""
        server.on_this_loop()
        async with server.lock:
            if server.probed:
                return
            try:
                response = await self._client.get(f"{server.root}/nonstop/state")
            except RETRYABLE_ERRORS as error:
                raise Unreachable(f"GET {server.root}/nonstop/state: {error}") from error
            if response.status_code in RETRYABLE_STATUS:
                raise Unreachable(f"GET {server.root}/nonstop/state -> {response.status_code}")
            if response.status_code == 200:
                state = response.json()
                server.nonstop = True
                server.model = state.get("model")
                slots = int(state.get("max_slots", 1))
                if slots != server.max_slots:
                    server.max_slots, server.slots = slots, None  # sized anew when next used
                server.max_len = state.get("max_len")
                server.version = int(state.get("policy_version", 0))
            elif response.status_code in (401, 403):
                message, body = error_message(response)
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
            if ((server.nonstop or server.vllm)
                    and (self._blob is not None or self._unencoded is not None)
                    and (server.version is None or server.version < self._blob_version)):
                started = time.perf_counter()
                await asyncio.to_thread(self._push_last, server)
                self._sync_s += time.perf_counter() - started
            server.probed = True
            if self._max_slots_given is None:
                slots = sum(s.max_slots for s in self._servers)
                self.config = dataclasses.replace(self.config, max_slots=slots)

    async def _probe_vllm(self, server: Server) -> None:
        """Whether `server` has vLLM's dev endpoints (GET /is_paused answers), and the weight
        version it reports (an int this client set, else unknown: "default" after a start)."""
        try:
            paused = await self._client.get(f"{server.root}/is_paused")
            if paused.status_code != 200:
                server.vllm = False
                return
            info = await self._client.get(f"{server.root}/weight_info")
        except RETRYABLE_ERRORS as error:
            raise Unreachable(f"GET {server.root}/is_paused: {error}") from error
        server.vllm, server.version = True, None
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            server.version = int(info.json().get("weight_version"))

    async def _pick(self, session: RemoteSession | None) -> Server:
        """The server for the next attempt, probed and with this request counted in its
        `in_flight` (the caller releases it), or `Unreachable` when none is up."""
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
            raise Unreachable("no rollout server is up")
        server = min(live, key=lambda s: (s.in_flight / max(s.max_slots, 1), s.in_flight,
                                          s.picks))
        server.in_flight += 1
        server.picks += 1  # counted while it is probed, so others spread meanwhile
        if not server.probed:
            try:
                await self._probe(server)
            except BaseException as error:
                server.in_flight -= 1
                if isinstance(error, Unreachable):
                    self._mark_down(server, str(error))
                raise
        if session is not None:
            self._pinned[session.id] = server
        return server

    # ---------------------------------------------------------------- generate

    async def _model_name(self, server: Server) -> str:
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

    async def _within_slots(self, server: Server, body: dict) -> dict:
        """POST /completions to `server`, for a `nonstop serve` once one of its slots is free
        here: requests past its slots would only wait on the server, where they slow every
        request it serves (`docs/engine.md`). Other servers take what they are sent."""
        slots = None
        if server.nonstop:
            server.on_this_loop()
            if server.slots is None:
                server.slots = asyncio.Semaphore(max(server.max_slots, 1))
            slots = server.slots
            self._waiting += 1
            try:
                await slots.acquire()
            finally:
                self._waiting -= 1
        self._sent += 1
        try:
            return await self._once(server, "POST", "/completions", json=body)
        finally:
            self._sent -= 1
            if slots is not None:
                slots.release()

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
                            return joined(done, "length")
                    body = completion_request(await self._model_name(server), prompt,
                                              part_params)
                    if session is not None and server.nonstop:
                        body["session_id"] = self._session_key(session)
                    response = await self._within_slots(server, body)
                finally:
                    server.in_flight -= 1
                part = parse_completion(
                    response, server, self.policy_version if version is None else version)
                if (part.finish_reason == "aborted" and server.vllm
                        and (server.updates != updates or not server.ready.is_set())):
                    done.append(part)  # aborted by our weight update: go on from its tokens
                    self._counts["restarted"] += 1
                    continue
                return joined([*done, part], part.finish_reason) if done else part
            except Unreachable as error:
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

    def _version_of(self, server: Server) -> int:
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

    # ---------------------------------------------------------------- weights

    def update_weights(self, params: nnx.State, version: int) -> None:
        """Publish `params` (the policy's `nnx.Param` state) as `version` to every live
        server; returns once each has taken them (see the module docstring). With
        `publish=False`, only keep them for servers found behind."""
        if self._graphdef is None:
            raise EngineError("RemoteEngine.update_weights needs the policy's architecture: "
                              "pass policy=<the trainer's model> to RemoteEngine")
        for server in self._servers:
            if server.probed and not (server.nonstop or server.vllm):
                raise takes_no_weights(server)
        started = time.perf_counter()
        targets: list[Server] = []
        with perf.span("engine/weight_update", policy_version=int(version)):
            if self._publish:
                blob, kept = encode_weights(self._graphdef, params, self._rest,
                                            self._weight_dtype), None
            else:  # encoded only if a server is found behind (`_push_last`); a snapshot,
                # as the caller's model may change meanwhile
                blob, kept = None, jax.tree.map(lambda x: x, params)
            with self._blob_lock:
                self._blob, self._unencoded, self._blob_version = blob, kept, int(version)
            if blob is not None:
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

    def _push_last(self, server: Server) -> None:
        """Bring `server` to the last update (encoded first if it was kept as weights)."""
        with self._blob_lock:
            if self._blob is None:
                self._blob = encode_weights(self._graphdef, self._unencoded, self._rest,
                                            self._weight_dtype)
                self._unencoded = None
            blob, version = self._blob, self._blob_version
        self._pusher.push(server, blob, version)

    def _try_push(self, server: Server, blob: bytes, version: int) -> bool:
        try:
            self._pusher.push(server, blob, version)
            return True
        except Unreachable as error:
            self._mark_down(server, str(error))
            return False

__all__ = ["RemoteEngine", "RemoteEngineError", "RemoteLimits", "RemoteRequestError",
           "RemoteSession", "RemoteStats", "WeightTransfer"]
