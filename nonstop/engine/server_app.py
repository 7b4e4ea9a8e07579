"""nonstop's OpenAI-compatible server as a running app: `build_app` routes the OpenAI endpoints
to an `OpenAIServing`'s handlers (nonstop.engine.server) and the /nonstop ones to a
`RolloutAdmin` (server_admin), answering every error as OpenAI's JSON; `serve(ServerConfig(...))`
loads a Hugging Face checkpoint directory, starts an Engine on it and runs uvicorn until
interrupted (`nonstop serve`). The behaviour, metrics and limits are described in
docs/serving.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nonstop.engine import openai_protocol as wire
from nonstop.engine.config import EngineConfig
from nonstop.engine.openai_protocol import ProtocolError
from nonstop.engine.server import OpenAIServing
from nonstop.engine.server_admin import RolloutAdmin
from nonstop.engine.types import EngineError
from nonstop.models.tokenizer import Tokenizer
from nonstop.models.tool_parsers import TOOL_PARSERS
from nonstop.models.validation import check, check_choice

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the app

_GENERATION_ROUTES = {"/v1/completions", "/v1/chat/completions"}
_ADMIN_ROUTES = {"/nonstop/state", "/nonstop/weights", "/nonstop/pause", "/nonstop/resume"}


def _handle_errors(serving: OpenAIServing, handler: Callable[[Request], Awaitable[Response]]
                   ) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            response = await handler(request)
        except ProtocolError as error:
            response = JSONResponse(error.body(), status_code=error.status)
        except EngineError as error:
            response = JSONResponse(wire.error_body(f"the engine failed: {error}",
                                                    type="server_error", code=503),
                                    status_code=503)
        except Exception as error:  # noqa: BLE001 - answered as a 500, logged
            log.exception("request to %s failed", request.url.path)
            response = JSONResponse(wire.error_body(f"internal error: {error}",
                                                    type="server_error", code=500),
                                    status_code=500)
        path = request.url.path
        serving.metrics.count_request(path if path in _GENERATION_ROUTES | _ADMIN_ROUTES
                                      else "other", response.status_code)
        return response

    return endpoint


async def _http_error(request: Request, exc: Exception) -> Response:
    """404, 405 and other routing errors as OpenAI error JSON."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.url.path!r}; see /v1/models, /v1/completions, " \
                  "/v1/chat/completions, /health, /metrics, /version, /nonstop/state"
        kind: wire.ErrorType = "not_found_error"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path!r}"
        kind = "invalid_request_error"
    else:
        message, kind = str(exc.detail), "invalid_request_error"
    return JSONResponse(wire.error_body(message, type=kind, code=exc.status_code),
                        status_code=exc.status_code, headers=exc.headers)


def build_app(serving: OpenAIServing) -> Starlette:
    """The Starlette app routing the OpenAI endpoints to `serving`'s handlers and the /nonstop
    ones to a `RolloutAdmin`; while it runs (its lifespan), idle sessions are swept."""
    admin = RolloutAdmin(serving)

    def route(path: str, handler: Callable[[Request], Awaitable[Response]], method: str) -> Route:
        return Route(path, _handle_errors(serving, handler), methods=[method])

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(serving.sessions.sweep_forever())
        try:
            yield
        finally:
            sweeper.cancel()
            serving.sessions.close_all()

    return Starlette(routes=[
        route("/v1/completions", serving.completions, "POST"),
        route("/v1/chat/completions", serving.chat_completions, "POST"),
        route("/v1/models", serving.models, "GET"),
        route("/v1/models/{model:path}", serving.get_model, "GET"),
        route("/health", serving.health, "GET"),
        route("/version", serving.version, "GET"),
        route("/metrics", serving.prometheus, "GET"),
        route("/nonstop/state", admin.get_state, "GET"),
        route("/nonstop/weights", admin.weights, "POST"),
        route("/nonstop/pause", admin.pause, "POST"),
        route("/nonstop/resume", admin.resume, "POST"),
        route("/nonstop/sessions/{session_id:path}", admin.close_session, "DELETE"),
    ], exception_handlers={HTTPException: _http_error}, lifespan=lifespan)


# ---------------------------------------------------------------- running a server

API_KEY_ENV = "NONSTOP_API_KEY"
Dtype = Literal["float32", "bfloat16"]
DEFAULT_MAX_SLOTS, DEFAULT_MAX_LEN = 8, 2048  # the engine `nonstop serve` runs unless told


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """What `nonstop serve` runs: a checkpoint directory, where to listen, and its engine.

    `api_key=None` serves without authentication; `model_name=None` names the model after the
    checkpoint directory; `engine`: the engine's whole configuration (slots, context per
    sequence, KV layout, prefill and decode settings, `on_weight_update`: what requests running
    when new weights arrive do), its `max_len` clipped to the model's positions;
    `tool_parser=None` picks the parser from the chat template's tool-call syntax, else from the
    model family (none found: `tools` are refused); `session_ttl_s`: sessions opened by
    requests' `session_id` close after this many seconds idle."""

    model_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    engine: EngineConfig = dataclasses.field(default_factory=lambda: EngineConfig(
        max_slots=DEFAULT_MAX_SLOTS, max_len=DEFAULT_MAX_LEN))
    dtype: Dtype = "float32"
    tool_parser: str | None = None
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    session_ttl_s: float = 600.0

    def __post_init__(self) -> None:
        owner = "ServerConfig"
        check(isinstance(self.engine, EngineConfig), owner, "engine", self.engine,
              "an EngineConfig")
        check(isinstance(self.port, int) and 0 <= self.port <= 65535, owner, "port", self.port,
              "an int in [0, 65535]")
        check_choice(owner, "dtype", self.dtype, Dtype)
        check(self.api_key is None or bool(self.api_key), owner, "api_key", self.api_key,
              "None (no authentication) or a non-empty string")
        check(self.tool_parser is None or self.tool_parser in TOOL_PARSERS, owner, "tool_parser",
              self.tool_parser, f"None (from the checkpoint) or one of {TOOL_PARSERS}")
        ttl = self.session_ttl_s
        check(isinstance(ttl, int | float) and not isinstance(ttl, bool) and ttl > 0, owner,
              "session_ttl_s", ttl, "seconds > 0")


def _say(message: str) -> None:
    """Startup progress on the console (stdout, flushed), whatever the log level; stderr keeps
    errors alone, one line each."""
    print(f"nonstop serve: {message}", flush=True)


def _chat_template_source(tokenizer: Tokenizer) -> str | None:
    try:
        return tokenizer.get_chat_template(None, tools=True)
    except Exception:  # noqa: BLE001 - no template: the family decides
        return None


def serve(config: ServerConfig) -> None:
    """Load `config.model_dir`, start an Engine on it and serve it with uvicorn until stopped."""
    import jax.numpy as jnp
    import uvicorn

    from nonstop.engine.engine import Engine, gc_heap_frozen
    from nonstop.engine.scoring import Scorer
    from nonstop.models import Decoder, load_pretrained
    from nonstop.models.tool_parsers import parser_name_for

    model_dir = Path(config.model_dir)
    started = time.perf_counter()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    model = load_pretrained(model_dir, dtype=getattr(jnp, config.dtype))
    engine_config = dataclasses.replace(
        config.engine, max_len=min(config.engine.max_len, model.cfg.max_position_embeddings))
    max_len = engine_config.max_len
    # Said once the checkpoint has loaded: a directory that fails to load is one error line.
    _say(f"loaded {model_dir} ({model.cfg.family}, {config.dtype}) in "
         f"{time.perf_counter() - started:.1f} s; compiling the engine "
         f"(max_slots={engine_config.max_slots}, max_len={max_len}, "
         f"kv_layout={engine_config.kv_layout}) ...")
    engine = Engine(model, engine_config, tokenizer=tokenizer)
    compile_start = time.perf_counter()
    engine.start()  # compiles before the port opens, so /health answering means ready
    tool_parser = config.tool_parser or parser_name_for(_chat_template_source(tokenizer),
                                                        model.cfg.family)
    _say(f"compiled in {time.perf_counter() - compile_start:.1f} s; tool-call parser: "
         f"{tool_parser or 'none (tools are refused; see --tool-parser)'}")
    serving = OpenAIServing(engine, tokenizer,
                            model_name=config.model_name or model_dir.resolve().name,
                            max_len=max_len, api_key=config.api_key, tool_parser=tool_parser,
                            scorer=Scorer(model, max_len) if isinstance(model, Decoder) else None,
                            model=model, session_ttl_s=config.session_ttl_s)

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                _say(f"ready at http://{host}:{port}/v1 (model {serving.model_name!r}, "
                     f"{time.perf_counter() - started:.1f} s after start)")

    server = Server(uvicorn.Config(build_app(serving), host=config.host, port=config.port,
                                   log_level=config.log_level))
    try:
        with gc_heap_frozen():  # collections skip the model and JAX, and pause threads less
            server.run()
    finally:
        engine.close()


__all__ = ["API_KEY_ENV", "DEFAULT_MAX_LEN", "DEFAULT_MAX_SLOTS", "Dtype", "ServerConfig", "build_app",
           "serve"]
