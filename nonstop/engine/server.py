"""nonstop's OpenAI-compatible HTTP server: the local Engine behind /v1/completions,
/v1/chat/completions, /v1/models and /health, as a Starlette app run by uvicorn.

`build_app(OpenAIServing(engine.generate, tokenizer, ...))` makes the ASGI app;
`serve(ServerConfig(...))` loads a Hugging Face checkpoint directory, starts an Engine on it and
runs uvicorn until interrupted. The wire format and its vLLM-style extensions are in
`openai_protocol`; stops, `max_tokens`, `n`, logprobs, streaming and auth are described in
docs/engine.md, "`nonstop serve`".
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nonstop.engine import openai_protocol as wire
from nonstop.engine.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    SamplingFields,
)
from nonstop.engine.sampling import SamplingParams
from nonstop.engine.types import Completion, RequestError
from nonstop.models.chat import ChatTemplate
from nonstop.models.tokenizer import Tokenizer
from nonstop.models.validation import check, check_choice, check_int

log = logging.getLogger(__name__)

Generate = Callable[[list[int], SamplingParams], Awaitable[Completion]]


@dataclasses.dataclass(frozen=True)
class _Choice:
    """One finished generation, rendered for the wire."""

    index: int
    prompt_tokens: tuple[int, ...]
    completion: Completion
    deltas: tuple[str, ...]  # text added by each token; "".join(deltas) is the returned text

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    @property
    def finish_reason(self) -> str:
        return wire.WIRE_FINISH_REASONS.get(self.completion.finish_reason, "stop")


def text_deltas(tokenizer: Tokenizer, tokens: Sequence[int], *, skip_special_tokens: bool,
                stop: Sequence[str] = ()) -> list[str]:
    """The text each token adds, by incremental detokenization over a short window (holding text
    back while it ends in an incomplete UTF-8 sequence), cut before the first stop string."""
    deltas: list[str] = []
    prefix, read = 0, 0
    for i in range(len(tokens)):
        last = i == len(tokens) - 1
        before = tokenizer.decode(tokens[prefix:read], skip_special_tokens=skip_special_tokens)
        after = tokenizer.decode(tokens[prefix:i + 1], skip_special_tokens=skip_special_tokens)
        if (len(after) > len(before) and not after.endswith("\ufffd")) or last:
            deltas.append(after[len(before):])
            prefix, read = read, i + 1
        else:
            deltas.append("")
    if stop:
        text = "".join(deltas)
        cut = min((p for s in stop if (p := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            kept, total = [], 0
            for delta in deltas:
                kept.append(delta[: max(0, cut - total)])
                total += len(delta)
            deltas = kept
    return deltas


class OpenAIServing:
    """The request handlers; one per app, holding the engine, tokenizer and served model name."""

    def __init__(self, generate: Generate, tokenizer: Tokenizer, *, model_name: str,
                 vocab_size: int, max_len: int, api_key: str | None = None):
        self._generate = generate
        self._tokenizer = tokenizer
        self.model_name = model_name
        self._vocab_size = vocab_size
        self._max_len = max_len
        self._api_key = api_key
        self._created = int(time.time())

    # ---------------------------------------------------------------- plumbing

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                  self._api_key.encode()):
            raise ProtocolError("missing or invalid API key: send 'Authorization: Bearer <key>'",
                                status=401, type="authentication_error")

    async def _body(self, request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ProtocolError(f"the request body is not valid JSON: {error}") from error

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ProtocolError(f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", status=404,
                                type="not_found_error")

    def _sampling_params(self, fields: SamplingFields, prompt_len: int, choice: int) -> SamplingParams:
        stop_ids = list(fields.stop_token_ids)
        bad = [t for t in stop_ids if not 0 <= t < self._vocab_size]
        if bad:
            raise ProtocolError(f"stop_token_ids {bad} are outside the vocabulary "
                                f"[0, {self._vocab_size})", param="stop_token_ids")
        if not fields.ignore_eos:
            stop_ids += [t for t in self._tokenizer.eos_ids if t not in stop_ids]
        del prompt_len  # the engine ends a generation that fills the context ("cache_full")
        try:
            return SamplingParams(
                temperature=fields.temperature,
                top_k=fields.top_k or 0,
                top_p=fields.top_p,
                max_tokens=fields.max_tokens,
                stop_token_ids=tuple(stop_ids),
                stop=fields.stop,
                seed=None if fields.seed is None else fields.seed + choice,
            )
        except ValueError as error:
            raise ProtocolError(f"invalid sampling parameters: {error}") from error

    def _prompt_tokens(self, prompt: wire.Prompt) -> tuple[int, ...]:
        tokens = (tuple(self._tokenizer.encode(prompt, add_special_tokens=True))
                  if isinstance(prompt, str) else prompt)
        wire.check_prompt_tokens(tokens, vocab_size=self._vocab_size, max_len=self._max_len)
        return tokens

    def _chat_prompt_tokens(self, req: ChatCompletionRequest) -> tuple[int, ...]:
        try:
            template = ChatTemplate.from_tokenizer(self._tokenizer, tools=req.tools is not None)
            text = template.render(req.messages, tools=req.tools,
                                   add_generation_prompt=req.add_generation_prompt,
                                   variables=req.chat_template_kwargs)
        except Exception as error:  # a template error is the request's fault: report it
            raise ProtocolError(f"could not render the messages with the chat template: {error}",
                                param="messages") from error
        tokens = tuple(self._tokenizer.encode(text, add_special_tokens=False))
        wire.check_prompt_tokens(tokens, vocab_size=self._vocab_size, max_len=self._max_len,
                                 param="messages")
        return tokens

    async def _run(self, index: int, prompt: tuple[int, ...], params: SamplingParams,
                   fields: SamplingFields) -> _Choice:
        try:
            completion = await self._generate(list(prompt), params)
        except RequestError as error:
            raise ProtocolError(str(error)) from error
        stop_string = completion.stop_reason if isinstance(completion.stop_reason, str) else None
        deltas = text_deltas(self._tokenizer, completion.tokens,
                             skip_special_tokens=fields.skip_special_tokens,
                             stop=() if stop_string is None else (stop_string,))
        return _Choice(index=index, prompt_tokens=prompt, completion=completion,
                       deltas=tuple(deltas))

    def _labels(self, tokens: Sequence[int], as_token_ids: bool) -> list[str]:
        return [wire.token_label(t, self._tokenizer.decode([t]), as_token_id=as_token_ids)
                for t in tokens]

    # ---------------------------------------------------------------- shared request flow

    def _plan(self, fields: SamplingFields, prompts: Sequence[tuple[int, ...]]
              ) -> list[tuple[int, tuple[int, ...], SamplingParams]]:
        """(choice index, prompt, params) for every choice: n per prompt, validated up front."""
        return [(p * fields.n + i, prompt, self._sampling_params(fields, len(prompt), i))
                for p, prompt in enumerate(prompts) for i in range(fields.n)]

    async def _gather(self, plan, fields: SamplingFields) -> list[_Choice]:
        tasks = [asyncio.ensure_future(self._run(i, prompt, params, fields))
                 for i, prompt, params in plan]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _as_finished(self, plan, fields: SamplingFields) -> AsyncIterator[_Choice]:
        tasks = [asyncio.ensure_future(self._run(i, prompt, params, fields))
                 for i, prompt, params in plan]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for task in tasks:
                task.cancel()

    def _extras(self, choice: _Choice, tokens: Sequence[int], versions: Sequence[int],
                return_token_ids: bool, *, final: bool) -> dict[str, Any]:
        extras: dict[str, Any] = {"policy_versions": [int(v) for v in versions]}
        if return_token_ids:
            extras["token_ids"] = [int(t) for t in tokens]
        if final:
            extras["stop_reason"] = choice.completion.stop_reason
            extras["engine_finish_reason"] = choice.completion.finish_reason
        return extras

    def _stream(self, plan, fields: SamplingFields, chunk: Callable[[_Choice, int, int], dict],
                header: Callable[[_Choice], dict | None], envelope: dict[str, Any]
                ) -> StreamingResponse:
        """SSE: per choice, an optional header chunk, one chunk per token with text, and usage."""

        async def events() -> AsyncIterator[bytes]:
            prompt_total, completion_total = 0, 0
            try:
                async for choice in self._as_finished(plan, fields):
                    if (first := header(choice)) is not None:
                        yield wire.sse_event({**envelope, "choices": [first]})
                    count = len(choice.completion.tokens)
                    for start in range(count):
                        yield wire.sse_event({**envelope, "choices": [chunk(choice, start, count)]})
                    if choice.index % fields.n == 0:
                        prompt_total += len(choice.prompt_tokens)
                    completion_total += count
            except ProtocolError as error:
                yield wire.sse_event(error.body())
            except Exception as error:
                log.exception("streaming request failed")
                yield wire.sse_event(wire.error_body(f"internal error: {error}", type="server_error",
                                                     code=500))
            else:
                if fields.include_usage:
                    yield wire.sse_event({**envelope, "choices": [],
                                          "usage": wire.usage(prompt_total, completion_total)})
            yield wire.SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ---------------------------------------------------------------- /v1/completions

    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        req: CompletionRequest = wire.parse_completion_request(await self._body(request))
        self._check_model(req.model)
        if req.logprobs:
            raise ProtocolError("logprobs > 0 (top alternatives) is not supported: nonstop's "
                                "engine records the sampled token's logprob only; use logprobs=0",
                                param="logprobs")
        fields = req.sampling
        plan = self._plan(fields, [self._prompt_tokens(p) for p in req.prompts])
        envelope = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                    "created": int(time.time()), "model": self.model_name}

        def body(choice: _Choice, start: int, stop: int, *, final: bool) -> dict[str, Any]:
            c = choice.completion
            tokens, logprobs = c.tokens[start:stop], c.logprobs[start:stop]
            out: dict[str, Any] = {"index": choice.index,
                                   "text": "".join(choice.deltas[start:stop]), "logprobs": None,
                                   "finish_reason": choice.finish_reason if final else None}
            if req.logprobs is not None:
                labels = self._labels(tokens, req.return_tokens_as_token_ids)
                offsets = list(itertools.accumulate(
                    (len(d) for d in choice.deltas[:stop - 1]), initial=0))[start:stop]
                out["logprobs"] = wire.completion_logprobs(
                    labels, logprobs, [[(lab, lp)] for lab, lp in zip(labels, logprobs, strict=True)],
                    offsets)
            out.update(self._extras(choice, tokens, c.policy_versions[start:stop],
                                    req.return_token_ids, final=final))
            if req.return_token_ids and start == 0:
                out["prompt_token_ids"] = list(choice.prompt_tokens)
            return out

        if fields.stream:
            return self._stream(
                plan, fields,
                lambda ch, i, n: body(ch, i, i + 1, final=i == n - 1),
                lambda ch: None, envelope)
        choices = await self._gather(plan, fields)
        prompt_tokens = sum(len(ch.prompt_tokens) for ch in choices[:: fields.n])
        return JSONResponse({
            **envelope,
            "choices": [body(ch, 0, len(ch.completion.tokens), final=True) for ch in choices],
            "usage": wire.usage(prompt_tokens, sum(len(ch.completion.tokens) for ch in choices)),
        })

    # ---------------------------------------------------------------- /v1/chat/completions

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        req: ChatCompletionRequest = wire.parse_chat_request(await self._body(request))
        self._check_model(req.model)
        if req.top_logprobs:
            raise ProtocolError("top_logprobs > 0 is not supported: nonstop's engine records the "
                                "sampled token's logprob only; use top_logprobs=0",
                                param="top_logprobs")
        fields = req.sampling
        plan = self._plan(fields, [self._chat_prompt_tokens(req)])
        envelope = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                    "model": self.model_name}

        def logprobs_of(choice: _Choice, start: int, stop: int) -> dict[str, Any] | None:
            if not req.logprobs:
                return None
            c = choice.completion
            labels = self._labels(c.tokens[start:stop], req.return_tokens_as_token_ids)
            return wire.chat_logprobs(labels, c.logprobs[start:stop], [[] for _ in labels])

        def extras(choice: _Choice, start: int, stop: int, *, final: bool) -> dict[str, Any]:
            c = choice.completion
            out = self._extras(choice, c.tokens[start:stop], c.policy_versions[start:stop],
                               req.return_token_ids, final=final)
            if req.return_token_ids and start == 0:
                out["prompt_token_ids"] = list(choice.prompt_tokens)
            return out

        if fields.stream:
            envelope["object"] = "chat.completion.chunk"

            def chunk(choice: _Choice, i: int, n: int) -> dict[str, Any]:
                final = i == n - 1
                return {"index": choice.index, "delta": {"content": choice.deltas[i]},
                        "logprobs": logprobs_of(choice, i, i + 1),
                        "finish_reason": choice.finish_reason if final else None,
                        **extras(choice, i, i + 1, final=final)}

            def header(choice: _Choice) -> dict[str, Any]:
                return {"index": choice.index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}

            return self._stream(plan, fields, chunk, header, envelope)
        choices = await self._gather(plan, fields)
        return JSONResponse({
            **envelope,
            "object": "chat.completion",
            "choices": [{"index": ch.index,
                         "message": {"role": "assistant", "content": ch.text},
                         "logprobs": logprobs_of(ch, 0, len(ch.completion.tokens)),
                         "finish_reason": ch.finish_reason,
                         **extras(ch, 0, len(ch.completion.tokens), final=True)}
                        for ch in choices],
            "usage": wire.usage(len(choices[0].prompt_tokens),
                                sum(len(ch.completion.tokens) for ch in choices)),
        })

    # ---------------------------------------------------------------- /v1/models, /health

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self._created,
            "owned_by": "nonstop", "max_model_len": self._max_len}]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})


def _handle_errors(handler: Callable[[Request], Awaitable[Response]]
                   ) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except ProtocolError as error:
            return JSONResponse(error.body(), status_code=error.status)
        except Exception as error:
            log.exception("request to %s failed", request.url.path)
            return JSONResponse(wire.error_body(f"internal error: {error}", type="server_error",
                                                code=500), status_code=500)

    return endpoint


def build_app(serving: OpenAIServing) -> Starlette:
    """The Starlette app routing the OpenAI endpoints to `serving`'s handlers."""
    routes = [
        Route("/v1/completions", _handle_errors(serving.completions), methods=["POST"]),
        Route("/v1/chat/completions", _handle_errors(serving.chat_completions), methods=["POST"]),
        Route("/v1/models", _handle_errors(serving.models), methods=["GET"]),
        Route("/health", _handle_errors(serving.health), methods=["GET"]),
    ]
    return Starlette(routes=routes)


# ---------------------------------------------------------------- running a server

API_KEY_ENV = "NONSTOP_API_KEY"
Dtype = Literal["float32", "bfloat16"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """What `nonstop serve` runs: a checkpoint directory, where to listen, and the engine's size.

    `api_key=None` serves without authentication; `model_name=None` names the model after the
    checkpoint directory; `max_len` is the engine's context (prompt plus generation) per slot."""

    model_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    max_slots: int = 8
    max_len: int = 2048
    dtype: Dtype = "float32"
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    def __post_init__(self) -> None:
        owner = "ServerConfig"
        check(isinstance(self.port, int) and 0 <= self.port <= 65535, owner, "port", self.port,
              "an int in [0, 65535]")
        check_int(owner, "max_slots", self.max_slots)
        check(isinstance(self.max_len, int) and self.max_len >= 2, owner, "max_len", self.max_len,
              "an int >= 2 (a prompt token and a generated one)")
        check_choice(owner, "dtype", self.dtype, Dtype)
        check(self.api_key is None or bool(self.api_key), owner, "api_key", self.api_key,
              "None (no authentication) or a non-empty string")

def serve(config: ServerConfig) -> None:
    """Load `config.model_dir`, start an Engine on it and serve it with uvicorn until stopped."""
    import jax.numpy as jnp
    import uvicorn

    from nonstop.engine.config import EngineConfig
    from nonstop.engine.engine import Engine, gc_heap_frozen
    from nonstop.models import load_pretrained

    model_dir = Path(config.model_dir)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    model = load_pretrained(model_dir, dtype=getattr(jnp, config.dtype))
    max_len = min(config.max_len, model.cfg.max_position_embeddings)
    engine = Engine(model, EngineConfig(max_slots=config.max_slots, max_len=max_len), tokenizer=tokenizer)
    engine.start()  # compiles before the port opens, so /health answering means ready
    serving = OpenAIServing(engine.generate, tokenizer,
                            model_name=config.model_name or model_dir.resolve().name,
                            vocab_size=model.cfg.vocab_size, max_len=max_len,
                            api_key=config.api_key)
    try:
        with gc_heap_frozen():  # collections skip the model and JAX, and pause threads less
            uvicorn.run(build_app(serving), host=config.host, port=config.port,
                        log_level=config.log_level)
    finally:
        engine.close()
