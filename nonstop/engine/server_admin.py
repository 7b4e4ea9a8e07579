"""What a trainer in another process needs from `nonstop serve`: the /nonstop routes.

    GET    /nonstop/state                 policy version, paused, load, limits, open sessions
    POST   /nonstop/weights               new weights: a safetensors blob (Hugging Face names and
                                          layouts) as the body (?version=N), or JSON
                                          {"version", "shm", "nbytes"} naming POSIX shared memory
    POST   /nonstop/pause, /nonstop/resume  hold new generation requests (running ones go on)
    DELETE /nonstop/sessions/{session_id}   close a session opened by a request's `session_id`

`SessionRegistry` maps the clients' `session_id`s to engine sessions (one turn in flight each,
closed after `ttl_s` idle by `sweep`), `PauseGate` holds generation requests while paused, and
`RolloutAdmin` answers the routes; `server_app.build_app` wires them. docs/serving.md, "Serving a
trainer", describes the protocol.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from nonstop.engine.openai_protocol import ProtocolError

if TYPE_CHECKING:
    from flax import nnx

    from nonstop.engine.protocol import RolloutSession, ServingEngine
    from nonstop.engine.server import OpenAIServing


# ---------------------------------------------------------------- sessions


@dataclasses.dataclass(eq=False)
class _OpenSession:
    session: RolloutSession
    last_used: float
    in_flight: bool = False


class SessionRegistry:
    """The engine sessions opened by clients' `session_id`s: a request's turn `acquire`s its
    session (opening it on first use) and `release`s it when done; one turn at a time. A session
    idle for more than `ttl_s` is closed by `sweep` (a later request with its id opens a new one:
    the same tokens, its context prefilled again)."""

    def __init__(self, engine: ServingEngine, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl_s > 0:
            raise ValueError(f"SessionRegistry: ttl_s={ttl_s!r}; valid: seconds > 0")
        self._engine = engine
        self.ttl_s = ttl_s
        self._clock = clock
        self._open: dict[str, _OpenSession] = {}

    def __len__(self) -> int:
        return len(self._open)

    def check_free(self, session_id: str) -> None:
        """Raise 409 if `session_id` has a turn in flight."""
        entry = self._open.get(session_id)
        if entry is not None and entry.in_flight:
            raise ProtocolError(f"session_id {session_id!r} already has a request in flight; "
                                "send a session's turns one at a time", param="session_id",
                                status=409)

    def acquire(self, session_id: str) -> RolloutSession:
        """The session of `session_id` (opened if new), marked in flight."""
        self.check_free(session_id)
        entry = self._open.get(session_id)
        if entry is None:
            entry = self._open[session_id] = _OpenSession(self._engine.session(), self._clock())
        entry.in_flight, entry.last_used = True, self._clock()
        return entry.session

    def release(self, session_id: str, session: RolloutSession) -> None:
        """The turn `acquire` started is over (unless the session was closed meanwhile)."""
        entry = self._open.get(session_id)
        if entry is not None and entry.session is session:
            entry.in_flight, entry.last_used = False, self._clock()

    def close(self, session_id: str) -> bool:
        """Close `session_id`'s session (a turn in flight finishes first); False if unknown."""
        entry = self._open.pop(session_id, None)
        if entry is None:
            return False
        entry.session.close()
        return True

    def sweep(self) -> int:
        """Close the sessions idle (no turn in flight) for more than `ttl_s`; how many."""
        now = self._clock()
        stale = [sid for sid, e in self._open.items()
                 if not e.in_flight and now - e.last_used > self.ttl_s]
        for sid in stale:
            self.close(sid)
        return len(stale)

    def close_all(self) -> None:
        for sid in list(self._open):
            self.close(sid)

    async def sweep_forever(self) -> None:
        """`sweep` every `ttl_s / 2` seconds (at most 30), until cancelled."""
        while True:
            await asyncio.sleep(min(self.ttl_s / 2, 30.0))
            self.sweep()


# ---------------------------------------------------------------- pause


class PauseGate:
    """Holds new generation requests while paused; `held` counts those waiting."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.held = 0

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    async def wait(self) -> None:
        """Return at once unless paused, else once resumed."""
        if self._open.is_set():
            return
        self.held += 1
        try:
            await self._open.wait()
        finally:
            self.held -= 1


# ---------------------------------------------------------------- weights


def _version_in(value: Any, where: str) -> int:
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            pass
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"version must be an integer >= 0 ({where}), got {value!r:.40}",
                            param="version")
    return value


def _read_shared_memory(name: str, nbytes: int, read: Callable[[memoryview], Any]) -> Any:
    """`read` the first `nbytes` of the POSIX shared memory `name`, attached only: the client
    that created it unlinks it (Python 3.11's resource tracker would unlink it at our exit)."""
    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError as error:
        raise ProtocolError(f"shm: no shared memory named {name!r} on this host (the server "
                            "must run on the client's host, and the segment must still exist)",
                            param="shm") from error
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    try:
        if nbytes > shm.size:
            raise ProtocolError(f"nbytes={nbytes} but the shared memory {name!r} holds "
                                f"{shm.size} bytes", param="nbytes")
        view = shm.buf[:nbytes]
        try:
            return read(view)
        finally:
            view.release()
    finally:
        shm.close()


class RolloutAdmin:
    """The /nonstop route handlers over one `OpenAIServing` (its engine, model, sessions and
    pause gate). Weight posts are serialized; decoding runs off the event loop."""

    def __init__(self, serving: OpenAIServing) -> None:
        self._serving = serving
        self._weights_lock = asyncio.Lock()
        self._posted: int | None = None  # the last version posted to the engine

    @property
    def policy_version(self) -> int:
        """The version new requests sample with (posted to the engine, maybe not applied)."""
        version = self._serving.engine.policy_version
        return version if self._posted is None else max(version, self._posted)

    def state(self) -> dict[str, Any]:
        serving, engine = self._serving, self._serving.engine
        stats = engine.stats()
        return {"policy_version": self.policy_version, "paused": serving.gate.paused,
                "running": stats.active_slots, "waiting": stats.waiting + serving.gate.held,
                "max_slots": engine.config.max_slots, "max_len": serving.max_len,
                "sessions": len(serving.sessions), "model": serving.model_name}

    async def get_state(self, request: Request) -> Response:
        self._serving.authorize(request)
        return JSONResponse(self.state())

    async def pause(self, request: Request) -> Response:
        self._serving.authorize(request)
        self._serving.gate.pause()
        return JSONResponse(self.state())

    async def resume(self, request: Request) -> Response:
        self._serving.authorize(request)
        self._serving.gate.resume()
        return JSONResponse(self.state())

    async def close_session(self, request: Request) -> Response:
        self._serving.authorize(request)
        session_id = request.path_params["session_id"]
        if not self._serving.sessions.close(session_id):
            raise ProtocolError(f"no open session {session_id!r} (closed already, or idle past "
                                "the server's --session-ttl-s)", param="session_id", status=404,
                                type="not_found_error")
        return JSONResponse({"session_id": session_id, "closed": True})

    async def weights(self, request: Request) -> Response:
        serving = self._serving
        serving.authorize(request)
        model = serving.model
        if model is None:
            raise ProtocolError("this server was built without its model "
                                "(OpenAIServing(model=...)), so it cannot load weights")
        kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind == "application/octet-stream":
            version = _version_in(request.query_params.get("version"), "query parameter")
            blob = bytearray()
            async for chunk in request.stream():
                blob += chunk
            nbytes = len(blob)

            def load() -> nnx.State:
                return _decode(model, blob)
        elif kind == "application/json":
            body = await serving.json_body(request)
            if not isinstance(body, dict):
                raise ProtocolError("the body must be a JSON object {\"version\", \"shm\", "
                                    "\"nbytes\"}")
            version = _version_in(body.get("version"), "body")
            name, nbytes = body.get("shm"), body.get("nbytes")
            if not isinstance(name, str) or not name:
                raise ProtocolError(f"shm must name a POSIX shared-memory segment, got "
                                    f"{name!r:.80}", param="shm")
            if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
                raise ProtocolError(f"nbytes must be an integer > 0, got {nbytes!r:.40}",
                                    param="nbytes")

            def load() -> nnx.State:
                return _read_shared_memory(name, nbytes, lambda view: _decode(model, view))
        else:
            raise ProtocolError(
                f"Content-Type {kind or 'none'!r}: send application/octet-stream (a safetensors "
                "blob, ?version=N) or application/json ({\"version\", \"shm\", \"nbytes\"})",
                param="Content-Type")
        received = time.perf_counter()
        async with self._weights_lock:
            current = self.policy_version
            if version < current:
                raise ProtocolError(f"version {version} is older than this server's policy "
                                    f"version {current}; send a version >= {current}",
                                    param="version", status=409)
            await asyncio.to_thread(self._update, load, version)
            self._posted = version
        return JSONResponse({"policy_version": version,
                             "seconds": time.perf_counter() - received, "bytes": nbytes})

    def _update(self, load: Callable[[], nnx.State], version: int) -> None:
        """Decode and post (a worker thread's work: streams keep flowing meanwhile)."""
        from nonstop.engine.engine import Engine

        state = load()
        engine = self._serving.engine
        try:
            if isinstance(engine, Engine):
                engine.update_weights(state, version, copy=False)  # the arrays are ours alone
            else:
                engine.update_weights(state, version)
        except ValueError as error:
            raise ProtocolError(f"the engine refused the weights: {error}") from error


def _decode(model: nnx.Module, blob: bytes | bytearray | memoryview) -> nnx.State:
    from nonstop.engine.weight_transfer import WeightsMismatchError, decode_weights

    try:
        return decode_weights(model, blob)
    except WeightsMismatchError as error:
        raise ProtocolError(f"weights: {error}; the server keeps its weights") from error


__all__ = ["PauseGate", "RolloutAdmin", "SessionRegistry"]
