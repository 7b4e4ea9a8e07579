"""nonstop's OpenAI-compatible HTTP server: `OpenAIServing`, the request handlers that put the
local Engine behind /v1/completions, /v1/chat/completions, /v1/models, /metrics, /version and
/health. The /nonstop routes a trainer in another process drives (weights, pause, state,
sessions) are `server_admin`'s; `server_app` makes the Starlette app of both
(`build_app(OpenAIServing(engine, tokenizer, ...))`) and runs it with uvicorn
(`serve(ServerConfig(...))`, `nonstop serve`).

Streams are incremental (one SSE chunk per engine decode call; each choice in flight is a
`server_choice.Choice`), tool calls are parsed into `tool_calls` (nonstop.models.tool_parsers),
and `echo` / `top_logprobs` read a full forward (`scoring.Scorer`). The wire format is in
`openai_protocol`; the behaviour, metrics and limits are described in docs/serving.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import string
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

import nonstop
from nonstop.engine import openai_protocol as wire
from nonstop.engine.detokenize import IncrementalText, text_deltas
from nonstop.engine.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    SamplingFields,
)
from nonstop.engine.sampling import SamplingParams
from nonstop.engine.server_admin import PauseGate, SessionRegistry
from nonstop.engine.server_choice import Choice
from nonstop.engine.server_metrics import Metrics
from nonstop.engine.types import Completion, RequestError
from nonstop.models.chat import ChatTemplate, ToolCall
from nonstop.models.tokenizer import Tokenizer
from nonstop.models.tool_parsers import TOOL_PARSERS, get_parser

if TYPE_CHECKING:
    from flax import nnx

    from nonstop.engine.protocol import RolloutSession, ServingEngine
    from nonstop.engine.scoring import Scorer, Scores

log = logging.getLogger(__name__)


def _tool_call_id(parser: str) -> str:
    if parser == "mistral":  # Mistral's templates insist on 9 alphanumerics
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class OpenAIServing:
    """The request handlers; one per app, holding the engine, tokenizer and served model name.

    `scorer` (None: refused) serves `echo` and `top_logprobs`; `tool_parser` (a name in
    `TOOL_PARSERS`; None: chat tool calls stay text and `tools` are refused) reads tool calls.
    `model` (the engine's model; None: POST /nonstop/weights is refused) decodes posted weights;
    sessions opened by requests' `session_id` close after `session_ttl_s` idle.
    """

    def __init__(self, engine: ServingEngine, tokenizer: Tokenizer, *, model_name: str, max_len: int,
                 scorer: Scorer | None = None, tool_parser: str | None = None,
                 api_key: str | None = None, model: nnx.Module | None = None,
                 session_ttl_s: float = 600.0):
        self.engine = engine
        self._tokenizer = tokenizer
        self.model_name = model_name
        self._vocab_size = engine.model_config.vocab_size
        self.max_len = max_len
        self.model = model
        self.sessions = SessionRegistry(engine, session_ttl_s)
        self.gate = PauseGate()
        self._scorer = scorer
        self.tool_parser = tool_parser
        self._parser = None if tool_parser is None else get_parser(tool_parser)
        self._api_key = api_key
        self._created = int(time.time())
        self.metrics = Metrics()

    # ---------------------------------------------------------------- plumbing

    def authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                  self._api_key.encode()):
            raise ProtocolError("missing or invalid API key: send 'Authorization: Bearer <key>'",
                                status=401, type="authentication_error")

    async def json_body(self, request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ProtocolError(f"the request body is not valid JSON: {error}") from error

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ProtocolError(f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", status=404,
                                type="not_found_error")

    def _sampling_params(self, fields: SamplingFields, choice: int) -> SamplingParams:
        stop_ids = list(fields.stop_token_ids)
        bad = [t for t in stop_ids if not 0 <= t < self._vocab_size]
        if bad:
            raise ProtocolError(f"stop_token_ids {bad} are outside the vocabulary "
                                f"[0, {self._vocab_size})", param="stop_token_ids")
        if not fields.ignore_eos:
            stop_ids += [t for t in self._tokenizer.eos_ids if t not in stop_ids]
        try:
            return SamplingParams(
                temperature=fields.temperature,
                top_k=fields.top_k or 0,
                top_p=fields.top_p,
                # 0 (echo only) generates nothing; the params are never used then.
                max_tokens=None if fields.max_tokens is None else max(fields.max_tokens, 1),
                stop_token_ids=tuple(stop_ids),
                stop=fields.stop,
                seed=None if fields.seed is None else fields.seed + choice,
            )
        except ValueError as error:
            raise ProtocolError(f"invalid sampling parameters: {error}") from error

    def _prompt_tokens(self, prompt: wire.Prompt) -> tuple[int, ...]:
        tokens = (tuple(self._tokenizer.encode(prompt, add_special_tokens=True))
                  if isinstance(prompt, str) else prompt)
        wire.check_prompt_tokens(tokens, vocab_size=self._vocab_size, max_len=self.max_len)
        return tokens

    def _chat_prompt_tokens(self, req: ChatCompletionRequest, forced: str
                            ) -> tuple[int, ...]:
        try:
            template = ChatTemplate.from_tokenizer(self._tokenizer, tools=req.tools is not None)
            text = template.render(req.messages, tools=req.tools,
                                   add_generation_prompt=req.add_generation_prompt,
                                   variables=req.chat_template_kwargs)
        except Exception as error:  # a template error is the request's fault: report it
            raise ProtocolError(f"could not render the messages with the chat template: {error}",
                                param="messages") from error
        tokens = tuple(self._tokenizer.encode(text + forced, add_special_tokens=False))
        wire.check_prompt_tokens(tokens, vocab_size=self._vocab_size, max_len=self.max_len,
                                 param="messages")
        return tokens

    def _choices(self, fields: SamplingFields, prompts: Sequence[tuple[int, ...]],
                 arrival: float) -> list[Choice]:
        """Every choice of a request: n per prompt, validated up front."""
        return [Choice(index=p * fields.n + i, prompt_tokens=prompt,
                        params=self._sampling_params(fields, i),
                        text=IncrementalText(self._tokenizer,
                                             skip_special_tokens=fields.skip_special_tokens),
                        stop=fields.stop, arrival=arrival)
                for p, prompt in enumerate(prompts) for i in range(fields.n)]

    async def _generate(self, choice: Choice, updates: asyncio.Queue[Any],
                        session: RolloutSession | None) -> None:
        """Run one choice on the engine, recording each chunk and queueing (choice, new
        tokens) after it; an error is queued as (choice, exception)."""
        try:
            async for chunk in self.engine.stream(list(choice.prompt_tokens), choice.params,
                                                  session):
                now = time.perf_counter()
                n = len(chunk.tokens)
                if n:
                    if choice.last_token_at is None:
                        self.metrics.ttft.observe(now - choice.arrival)
                        if n > 1:
                            self.metrics.itl.observe(0.0, n - 1)
                    else:
                        self.metrics.itl.observe((now - choice.last_token_at) / n, n)
                    choice.last_token_at = now
                    self.metrics.generation_tokens += n
                for token in chunk.tokens:
                    choice.text.add(token)
                choice.logprobs += chunk.logprobs
                choice.versions += chunk.policy_versions
                if chunk.completion is not None:
                    choice.text.finish()
                    choice.completion = chunk.completion
                    self.metrics.e2e.observe(now - choice.arrival)
                await updates.put((choice, n))
        except RequestError as error:
            await updates.put((choice, ProtocolError(str(error))))
        except Exception as error:  # noqa: BLE001 - reported to the client, logged
            log.exception("generation failed")
            await updates.put((choice, error))

    def _check_session(self, session_id: str | None, choices: list[Choice]) -> None:
        if session_id is None:
            return
        if len(choices) > 1:
            raise ProtocolError(f"session_id: a session runs one sequence, but this request "
                                f"asks for {len(choices)} (n times the prompts); send n=1 and "
                                "one prompt", param="session_id")
        self.sessions.check_free(session_id)

    @contextlib.contextmanager
    def _turn(self, session_id: str | None) -> Iterator[RolloutSession | None]:
        """The session of `session_id` (None: none) for one turn."""
        if session_id is None:
            yield None
            return
        session = self.sessions.acquire(session_id)
        try:
            yield session
        finally:
            self.sessions.release(session_id, session)

    async def _run(self, choices: list[Choice], session_id: str | None = None
                   ) -> AsyncIterator[tuple[Choice, int]]:
        """(choice, new token count) as each engine chunk of any choice arrives, until all have
        finished; leaving early cancels the rest (their slots are freed). Waits first while the
        server is paused."""
        with self._turn(session_id) as session:
            await self.gate.wait()
            updates: asyncio.Queue[Any] = asyncio.Queue()
            tasks = [asyncio.create_task(self._generate(c, updates, session)) for c in choices]
            self.metrics.running += 1
            self.metrics.prompt_tokens += sum(len(c.prompt_tokens) for c in choices)
            try:
                pending = len(choices)
                while pending:
                    choice, item = await updates.get()
                    if isinstance(item, BaseException):
                        raise item
                    if choice.completion is not None:
                        pending -= 1
                    yield choice, item
            finally:
                self.metrics.running -= 1
                for task in tasks:
                    task.cancel()

    async def _finish_all(self, request: Request, choices: list[Choice],
                          session_id: str | None) -> None:
        """Run every choice to its end; a client that disconnects first cancels them."""

        async def consume() -> None:
            async for _ in self._run(choices, session_id):
                pass

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.create_task(consume())
        watch = asyncio.create_task(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                raise ProtocolError("the client disconnected", status=499)
        work.result()

    async def _scores(self, tokens: Sequence[int], param: str) -> Scores:
        if self._scorer is None:
            raise ProtocolError(f"{param}: this server has no scorer for its model (a "
                                "vision-language checkpoint); omit it", param=param)
        return await asyncio.to_thread(self._scorer.score, list(tokens))

    def _label(self, token: int, as_token_id: bool) -> str:
        return wire.token_label(token, self._tokenizer.decode([token]), as_token_id=as_token_id)

    def _top(self, scores: Scores, rows: range, k: int, as_token_id: bool
             ) -> list[list[tuple[str, float]]]:
        return [[(self._label(int(t), as_token_id), float(lp))
                 for t, lp in zip(scores.top_ids[r, :k], scores.top_logprobs[r, :k],
                                  strict=True)] for r in rows]

    def _sse(self, events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            try:
                async for event in events:
                    yield wire.sse_event(event)
            except ProtocolError as error:
                yield wire.sse_event(error.body())
            except Exception as error:  # noqa: BLE001 - reported in the stream, logged
                log.exception("streaming request failed")
                yield wire.sse_event(wire.error_body(f"internal error: {error}",
                                                     type="server_error", code=500))
            yield wire.SSE_DONE

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @staticmethod
    def _usage(choices: list[Choice], n: int) -> dict[str, int]:
        return wire.usage(sum(len(c.prompt_tokens) for c in choices[::n]),
                          sum(len(c.tokens) for c in choices))

    # ---------------------------------------------------------------- /v1/completions

    async def completions(self, request: Request) -> Response:
        self.authorize(request)
        req: CompletionRequest = wire.parse_completion_request(await self.json_body(request))
        self._check_model(req.model)
        if req.logprobs and self._scorer is None:
            raise ProtocolError("logprobs > 0 needs a scorer, which this model has not",
                                param="logprobs")
        fields = req.sampling
        prompts = [self._prompt_tokens(p) for p in req.prompts]
        choices = self._choices(fields, prompts, time.perf_counter())
        self._check_session(req.session_id, choices)
        envelope = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                    "created": int(time.time()), "model": self.model_name}
        k = req.logprobs or 0
        as_ids = req.return_tokens_as_token_ids

        async def logprobs_of(choice: Choice, start: int, stop: int, text_start: int
                              ) -> dict[str, Any] | None:
            if req.logprobs is None:
                return None
            tokens, lps = choice.tokens[start:stop], choice.logprobs[start:stop]
            labels = [self._label(t, as_ids) for t in tokens]
            top: list[list[tuple[str, float]]] = [[(lab, lp)] for lab, lp in
                                                  zip(labels, lps, strict=True)]
            if k and tokens:
                scores = await self._scores([*choice.prompt_tokens, *choice.tokens[:stop]],
                                            "logprobs")
                p = len(choice.prompt_tokens)
                top = [[*alts, *sampled] for alts, sampled in
                       zip(self._top(scores, range(p + start, p + stop), k, as_ids), top,
                           strict=True)]
            visible = len(choice.visible())
            ends = [min(e, visible) for e in choice.text.ends]
            offsets = [text_start + (ends[i - 1] if i else 0) for i in range(start, stop)]
            return wire.completion_logprobs(labels, lps, top, offsets)

        if fields.stream:
            async def events() -> AsyncIterator[dict[str, Any]]:
                async for choice, _ in self._run(choices, req.session_id):
                    final = choice.completion is not None
                    start, stop = choice.emitted, len(choice.tokens)
                    visible = choice.visible()
                    text, choice.sent, choice.emitted = visible[choice.sent:], len(visible), stop
                    yield {**envelope, "choices": [{
                        "index": choice.index, "text": text,
                        "logprobs": await logprobs_of(choice, start, stop, 0),
                        "finish_reason": choice.finish_reason if final else None,
                        **choice.extras(start, stop, req.return_token_ids, final=final)}]}
                if fields.include_usage:
                    yield {**envelope, "choices": [], "usage": self._usage(choices, fields.n)}

            return self._sse(events())

        if fields.max_tokens == 0:  # echo only: nothing to generate
            for choice in choices:
                choice.completion = Completion(tokens=(), logprobs=(), finish_reason="length",
                                               policy_versions=())
        else:
            await self._finish_all(request, choices, req.session_id)
        out = []
        for choice, prompt in zip(choices, [p for p in req.prompts for _ in range(fields.n)],
                                  strict=True):
            text = choice.visible()
            body: dict[str, Any] = {"index": choice.index, "text": text, "logprobs": None,
                                    "finish_reason": choice.finish_reason}
            if req.echo:
                echoed = (prompt if isinstance(prompt, str) else
                          self._tokenizer.decode(list(prompt),
                                                 skip_special_tokens=fields.skip_special_tokens))
                body["text"] = echoed + text
                if req.logprobs is not None:
                    body["logprobs"] = await self._echo_logprobs(choice, echoed, k, as_ids)
            else:
                body["logprobs"] = await logprobs_of(choice, 0, len(choice.tokens), 0)
            body.update(choice.extras(0, len(choice.tokens), req.return_token_ids, final=True))
            out.append(body)
        return JSONResponse({**envelope, "choices": out,
                             "usage": self._usage(choices, fields.n)})

    async def _echo_logprobs(self, choice: Choice, echoed: str, k: int, as_ids: bool
                             ) -> dict[str, Any]:
        """Logprobs over the prompt and the completion, the prompt's from a full forward (its
        first token has none: nothing predicts it)."""
        prompt = list(choice.prompt_tokens)
        scores = await self._scores([*prompt, *choice.tokens], "echo")
        p = len(prompt)
        labels = [self._label(t, as_ids) for t in [*prompt, *choice.tokens]]
        lps: list[float | None] = [None, *map(float, scores.logprobs[1:p]), *choice.logprobs]
        rows = range(p + len(choice.tokens))
        top: list[list[tuple[str, float]] | None] = []
        for r in rows:
            if r == 0:
                top.append(None)
                continue
            alts = self._top(scores, range(r, r + 1), k, as_ids)[0] if k else []
            lp = lps[r]
            assert lp is not None
            top.append([*alts, (labels[r], lp)])
        text = self._tokenizer.decode
        offsets = [len(text(prompt[:i])) if i < p else len(echoed) + (
            choice.text.ends[i - p - 1] if i > p else 0) for i in rows]
        return wire.completion_logprobs(labels, lps, top, [min(o, len(echoed) + len(
            choice.visible())) for o in offsets])

    # ---------------------------------------------------------------- /v1/chat/completions

    def _forced_prefix(self, req: ChatCompletionRequest) -> str:
        """The opening of a call written into the prompt for tool_choice "required" or a named
        function, so the model's turn can only be a call (to that function)."""
        if req.tool_choice in ("none", "auto"):
            return ""
        assert self._parser is not None
        return self._parser.call_prefix(None if req.tool_choice == "required"
                                        else req.tool_choice)

    def _tool_calls(self, req: ChatCompletionRequest, choice: Choice, forced: str
                    ) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI tool_calls) of a finished choice; no calls unless tools apply."""
        text = choice.visible()
        if self._parser is None or req.tool_choice == "none":
            return text, []
        turn = self._parser.parse(forced + text)
        calls = list(turn.tool_calls)
        if not req.parallel_tool_calls:
            calls = calls[:1]
        if forced:
            names = [t["function"]["name"] for t in req.tools or ()]
            wanted = names if req.tool_choice == "required" else [req.tool_choice]
            if not calls or any(c.name not in wanted for c in calls):
                if choice.finish_reason == "length":  # cut short: what there is, as text
                    return forced + text, []
                why = turn.errors[0].message if turn.errors else "no call of " + ", ".join(wanted)
                raise ProtocolError(
                    f"tool_choice={req.tool_choice!r}: the model's turn is not a valid call "
                    f"({why}): {(forced + text)[:200]!r}; nonstop forces the call's opening, "
                    "not its arguments (no constrained decoding): retry, or use 'auto'",
                    param="tool_choice", status=500, type="server_error")
        if not calls:
            return text, []
        return (turn.content or None), [self._wire_call(c, i) for i, c in enumerate(calls)]

    def _wire_call(self, call: ToolCall, index: int) -> dict[str, Any]:
        assert self.tool_parser is not None
        arguments = (call.arguments if isinstance(call.arguments, str)
                     else json.dumps(dict(call.arguments), ensure_ascii=False))
        return {"index": index, "id": _tool_call_id(self.tool_parser), "type": "function",
                "function": {"name": call.name, "arguments": arguments}}

    async def chat_completions(self, request: Request) -> Response:
        self.authorize(request)
        req: ChatCompletionRequest = wire.parse_chat_request(await self.json_body(request))
        self._check_model(req.model)
        if req.tools is not None and self._parser is None and req.tool_choice != "none":
            raise ProtocolError("tools: this server reads no tool calls (its chat template's "
                                "format is unknown); start it with --tool-parser "
                                f"{{{','.join(TOOL_PARSERS)}}}", param="tools")
        if req.top_logprobs and self._scorer is None:
            raise ProtocolError("top_logprobs > 0 needs a scorer, which this model has not",
                                param="top_logprobs")
        fields = req.sampling
        forced = self._forced_prefix(req)
        choices = self._choices(fields, [self._chat_prompt_tokens(req, forced)],
                                time.perf_counter())
        self._check_session(req.session_id, choices)
        envelope = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                    "model": self.model_name}
        as_ids = req.return_tokens_as_token_ids

        async def logprobs_of(choice: Choice, start: int, stop: int) -> dict[str, Any] | None:
            if not req.logprobs:
                return None
            tokens = choice.tokens[start:stop]
            labels = [self._label(t, as_ids) for t in tokens]
            top: list[list[tuple[str, float]]] = [[] for _ in labels]
            if req.top_logprobs and tokens:
                scores = await self._scores([*choice.prompt_tokens, *choice.tokens[:stop]],
                                            "top_logprobs")
                p = len(choice.prompt_tokens)
                top = self._top(scores, range(p + start, p + stop), req.top_logprobs, as_ids)
            return wire.chat_logprobs(labels, choice.logprobs[start:stop], top)

        tools_on = self._parser is not None and req.tool_choice != "none"

        if fields.stream:
            envelope["object"] = "chat.completion.chunk"

            async def events() -> AsyncIterator[dict[str, Any]]:
                for choice in choices:
                    yield {**envelope, "choices": [{
                        "index": choice.index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]}
                held: set[int] = set()  # choices whose text from `sent` on is a tool call
                async for choice, _ in self._run(choices, req.session_id):
                    final = choice.completion is not None
                    start, stop = choice.emitted, len(choice.tokens)
                    visible = choice.visible()
                    end = len(visible)
                    if forced or choice.index in held:
                        end = choice.sent  # a call: nothing more is content until it ends
                    elif tools_on:
                        n, started = self._parser.stream_split(visible)  # type: ignore[union-attr]
                        end = max(n, choice.sent)
                        if started:
                            held.add(choice.index)
                    delta: dict[str, Any] = {}
                    if end > choice.sent:
                        delta["content"] = visible[choice.sent:end]
                    choice.sent, choice.emitted = end, stop
                    finish = None
                    if final:
                        content, calls = (self._tool_calls(req, choice, forced) if tools_on
                                          else (visible, []))
                        if calls:
                            delta["tool_calls"] = calls
                            finish = "tool_calls"
                        else:
                            if content and len(content) > choice.sent:
                                delta["content"] = delta.get("content", "") + content[choice.sent:]
                            finish = choice.finish_reason
                    yield {**envelope, "choices": [{
                        "index": choice.index, "delta": delta,
                        "logprobs": await logprobs_of(choice, start, stop),
                        "finish_reason": finish,
                        **choice.extras(start, stop, req.return_token_ids, final=final)}]}
                if fields.include_usage:
                    yield {**envelope, "choices": [], "usage": self._usage(choices, fields.n)}

            return self._sse(events())

        await self._finish_all(request, choices, req.session_id)
        out = []
        for choice in choices:
            content, calls = (self._tool_calls(req, choice, forced) if tools_on
                              else (choice.visible(), []))
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            out.append({"index": choice.index, "message": message,
                        "logprobs": await logprobs_of(choice, 0, len(choice.tokens)),
                        "finish_reason": "tool_calls" if calls else choice.finish_reason,
                        **choice.extras(0, len(choice.tokens), req.return_token_ids, final=True)})
        return JSONResponse({**envelope, "object": "chat.completion", "choices": out,
                             "usage": self._usage(choices, fields.n)})

    # ---------------------------------------------------------------- models, health, metrics

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self._created,
                "owned_by": "nonstop", "max_model_len": self.max_len}

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        self.authorize(request)
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": nonstop.__version__})

    async def prometheus(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(self.engine),
                                 media_type="text/plain; version=0.0.4")


__all__ = ["IncrementalText", "Metrics", "OpenAIServing", "text_deltas"]
