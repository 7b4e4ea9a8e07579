"""The OpenAI-compatible wire format: request parsing and validation, response and error bodies.

Requests arrive as decoded JSON; `parse_completion_request` and `parse_chat_request` turn them into
frozen, typed requests or raise `ProtocolError` naming the offending field, its value and what is
valid, which the server answers with HTTP 400 and an OpenAI-style error body. Fields the OpenAI
schema lacks follow vLLM's extensions, so clients written for vLLM work unchanged:

- `prompt` may be token ids (a list of ints, or a batch of such lists), as vLLM accepts them.
- `top_k` (-1 or 0 disables it), `stop_token_ids`, `ignore_eos` (stop only on `stop_token_ids`,
  not on the checkpoint's end-of-sequence ids), `skip_special_tokens` (for the returned text).
- `return_token_ids`: each choice carries `token_ids` (sampled ids) and `prompt_token_ids`.
- `return_tokens_as_token_ids`: the tokens in logprobs are spelled "token_id:{id}".
- `session_id` (nonstop's; a string of at most 256 characters): the request is a turn of that
  session, whose KV cache the engine keeps between turns (one sequence: `n` 1, one prompt).

Each choice also carries vLLM's `stop_reason` (the stop token id or stop string that matched, else
null), and nonstop adds `policy_versions` (the weight version that sampled each token) and
`engine_finish_reason` (nonstop's "stop" | "length" | "cache_full" | "aborted"; the OpenAI
`finish_reason` folds cache_full into "length" and aborted into "abort", as vLLM does).

Tool calling follows vLLM: `tools`, `tool_choice` ("none", "auto", "required" or a named
function) and `parallel_tool_calls` (false: the first call only) are read here; the server parses
the model's calls. Unknown fields are ignored, as OpenAI does; known fields nonstop cannot honour
(penalties, logit_bias, suffix, best_of > n, response_format other than text, the legacy
functions/function_call, structured-output and audio fields) are refused with a 400 naming them
rather than silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error", "server_error"]

MAX_N = 128
MAX_TOP_LOGPROBS = 20
_INT64 = 2**63


class ProtocolError(ValueError):
    """A request the server refuses; `status` is the HTTP status it is answered with."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: ErrorType = "invalid_request_error",
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.status)


def error_body(
    message: str, *, type: ErrorType, param: str | None = None, code: int | str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------- field readers


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(f"{key} must be a boolean, got {value!r}", param=key)
    return value


def _int(
    body: Mapping[str, Any], key: str, default: int | None, *, lo: int, hi: int = _INT64 - 1
) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ProtocolError(f"{key} must be an integer in [{lo}, {hi}], got {value!r}", param=key)
    return value


def _float(body: Mapping[str, Any], key: str, default: float, *, lo: float, hi: float,
           lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        bracket = "(" if lo_open else "["
        raise ProtocolError(f"{key} must be a number in {bracket}{lo}, {hi}], got {value!r}",
                            param=key)
    return float(value)


def _token_ids(value: Any, key: str) -> tuple[int, ...] | None:
    """`value` as token ids if it is a list of ints, else None."""
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    return None


# Fields nonstop cannot honour, refused unless absent or null (or the listed no-op value).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": ([],), "function_call": ("none",), "audio": (), "prediction": (),
    "web_search_options": (), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "guided_decoding_backend": (), "structured_outputs": (),
    "prompt_logprobs": (), "min_tokens": (0,), "min_p": (0, 0.0), "logits_processors": (),
    "bad_words": ([],), "allowed_token_ids": (), "truncate_prompt_tokens": (),
    "reasoning_effort": (), "verbosity": (), "store": (False,),
}
_WHY = {
    "functions": "use tools", "function_call": "use tool_choice",
    "prompt_logprobs": "use echo=true with logprobs on /v1/completions",
    "reasoning_effort": "pass the chat template's own switch in chat_template_kwargs "
                        "(e.g. {\"enable_thinking\": false})",
    "store": "nothing is stored",
}


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for key, allowed in _UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and not any(value == a for a in allowed):
            why = f"; {_WHY[key]}" if key in _WHY else ""
            raise ProtocolError(f"{key} is not supported by nonstop{why}", param=key)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise ProtocolError("response_format is not supported by nonstop (no constrained "
                            "decoding); omit it or pass {\"type\": \"text\"}",
                            param="response_format")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise ProtocolError("modalities: nonstop produces text only; omit it or pass [\"text\"]",
                            param="modalities")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise ProtocolError(f"{key} is not supported by nonstop; omit it or pass 0", param=key)
    if body.get("repetition_penalty") not in (None, 1, 1.0):
        raise ProtocolError("repetition_penalty is not supported by nonstop; omit it or pass 1",
                            param="repetition_penalty")
    if body.get("logit_bias") not in (None, {}):
        raise ProtocolError("logit_bias is not supported by nonstop", param="logit_bias")


# ---------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingFields:
    """The sampling fields both endpoints share, validated; `top_k=None` means disabled and
    `max_tokens=None` means "until a stop or the end of the context"."""

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    include_usage: bool = False


def _parse_sampling(body: Mapping[str, Any], *, default_max_tokens: int | None,
                    min_max_tokens: int = 1) -> SamplingFields:
    _refuse_unsupported(body)
    # An explicit null means "no limit" (as in vLLM); an absent field takes the default.
    key = "max_tokens" if "max_tokens" in body else "max_completion_tokens"
    max_tokens = _int(body, key, default_max_tokens if key not in body else None,
                      lo=min_max_tokens)
    top_k = _int(body, "top_k", None, lo=-1)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise ProtocolError(f"stop must be a string or a list of strings, got {stop!r}",
                            param="stop")
    if any(not s for s in stops):
        raise ProtocolError("stop strings must be non-empty", param="stop")
    stop_ids = body.get("stop_token_ids")
    stop_token_ids = () if stop_ids is None else _token_ids(stop_ids, "stop_token_ids")
    if stop_token_ids is None:
        raise ProtocolError(f"stop_token_ids must be a list of integers, got {stop_ids!r}",
                            param="stop_token_ids")
    n = _int(body, "n", 1, lo=1, hi=MAX_N)
    best_of = _int(body, "best_of", None, lo=1, hi=MAX_N)
    if best_of is not None and best_of != n:
        raise ProtocolError(f"best_of must equal n ({n}) in nonstop, got {best_of}", param="best_of")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not (stream and isinstance(options, dict)):
        raise ProtocolError("stream_options is only allowed with stream=true, as an object",
                            param="stream_options")
    include_usage = _bool(options or {}, "include_usage", False)
    unknown = sorted(set(options or {}) - {"include_usage"})
    if unknown:
        raise ProtocolError(f"stream_options: nonstop supports include_usage only, got "
                            f"{unknown}", param="stream_options")
    return SamplingFields(
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 1.0, lo=0.0, hi=1e4),
        top_p=_float(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=None if top_k is None or top_k <= 0 else top_k,
        seed=_int(body, "seed", None, lo=-_INT64),
        stop=stops,
        stop_token_ids=stop_token_ids,
        ignore_eos=_bool(body, "ignore_eos", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        n=n,
        stream=stream,
        include_usage=include_usage,
    )


MAX_SESSION_ID = 256


def _session_id(body: Mapping[str, Any]) -> str | None:
    value = body.get("session_id")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_ID:
        raise ProtocolError(f"session_id must be a non-empty string of at most {MAX_SESSION_ID} "
                            f"characters, got {value!r:.80}", param="session_id")
    return value


def _model(body: Mapping[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError(f"model must be a string, got {model!r}", param="model")
    return model


Prompt = str | tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    """A /v1/completions request. `prompts` holds one entry per prompt of a batch; `logprobs` is
    the number of alternatives per position (0: only the sampled token's), None for none."""

    model: str | None
    prompts: tuple[Prompt, ...]
    sampling: SamplingFields
    logprobs: int | None = None
    echo: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    session_id: str | None = None


def _parse_prompts(prompt: Any) -> tuple[Prompt, ...]:
    what = "a string, a list of token ids, or a list of either"
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif (ids := _token_ids(prompt, "prompt")) is not None and ids:
        prompts = [ids]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise ProtocolError(f"prompt must be {what} (non-empty), got {prompt!r:.80}", param="prompt")
    parsed: list[Prompt] = []
    for i, entry in enumerate(prompts):
        if isinstance(entry, tuple):
            parsed.append(entry)
        elif isinstance(entry, str):
            if not entry:
                raise ProtocolError(f"prompt[{i}] is empty", param="prompt")
            parsed.append(entry)
        elif (ids := _token_ids(entry, "prompt")) is not None:
            if not ids:
                raise ProtocolError(f"prompt[{i}] is an empty list of token ids", param="prompt")
            parsed.append(ids)
        else:
            raise ProtocolError(f"prompt must be {what}; prompt[{i}] is {entry!r:.80}",
                                param="prompt")
    return tuple(parsed)


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a decoded /v1/completions JSON body."""
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type(body).__name__}")
    if "prompt" not in body:
        raise ProtocolError("prompt is required", param="prompt")
    if body.get("suffix"):
        raise ProtocolError("suffix is not supported by nonstop", param="suffix")
    echo = _bool(body, "echo", False)
    sampling = _parse_sampling(body, default_max_tokens=16, min_max_tokens=0 if echo else 1)
    if echo and sampling.stream:
        raise ProtocolError("echo is not supported with stream=true; send stream=false",
                            param="echo")
    return CompletionRequest(
        model=_model(body),
        prompts=_parse_prompts(body["prompt"]),
        sampling=sampling,
        logprobs=_int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS),
        echo=echo,
        return_token_ids=_bool(body, "return_token_ids", False),
        return_tokens_as_token_ids=_bool(body, "return_tokens_as_token_ids", False),
        session_id=_session_id(body),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatCompletionRequest:
    """A /v1/chat/completions request; `messages` are in transformers' chat-template form."""

    model: str | None
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    sampling: SamplingFields
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    session_id: str | None = None


_ROLES = ("system", "developer", "user", "assistant", "tool")

ToolChoice = Literal["none", "auto", "required"] | str
"""What the model may call: "none", "auto", "required", or (any other string) the one tool
named by {"type": "function", "function": {"name": ...}}."""
_TOOL_CHOICES = ("none", "auto", "required")


def _tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ProtocolError("tools must be a list of tool objects", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function"
                and isinstance(function, dict) and isinstance(function.get("name"), str)
                and function["name"]):
            raise ProtocolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                f"{{\"name\": str, ...}}}}, got {tool!r:.100}", param="tools")
    return tuple(tools)


def _tool_choice(body: Mapping[str, Any], tools: tuple[dict[str, Any], ...] | None) -> ToolChoice:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    names = [t["function"]["name"] for t in tools or ()]
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ProtocolError(f"tool_choice must be one of {_TOOL_CHOICES} or "
                                f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                                f"got {choice!r:.100}", param="tool_choice")
        if name not in names:
            raise ProtocolError(f"tool_choice names the function {name!r}, which is not in "
                                f"tools ({names})", param="tool_choice")
        if name in _TOOL_CHOICES:
            raise ProtocolError(f"tool_choice: a tool named {name!r} cannot be chosen by name",
                                param="tool_choice")
        return name
    if choice not in _TOOL_CHOICES:
        raise ProtocolError(f"tool_choice must be one of {_TOOL_CHOICES} or a named function, "
                            f"got {choice!r:.100}", param="tool_choice")
    if choice != "none" and not tools:
        raise ProtocolError(f"tool_choice={choice!r} needs tools; send tools or omit "
                            "tool_choice", param="tool_choice")
    return choice


def _message(message: Any, i: int) -> dict[str, Any]:
    """One OpenAI message as a chat template expects it: text content parts joined, the
    "developer" role read as "system"."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ProtocolError(f"{where} must be an object, got {message!r:.80}", param="messages")
    role = message.get("role")
    if role not in _ROLES:
        raise ProtocolError(f"{where}.role must be one of {_ROLES}, got {role!r}", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ProtocolError(f"{where}.content parts must be {{'type': 'text', 'text': str}}"
                                    f" (nonstop serves text only), got {part!r:.80}",
                                    param="messages")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ProtocolError(f"{where}.content must be a string or a list of text parts",
                            param="messages")
    out = {k: v for k, v in message.items() if v is not None}
    out.update(role="system" if role == "developer" else role, content=content)
    return out


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a decoded /v1/chat/completions JSON body."""
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type(body).__name__}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list of messages", param="messages")
    tools = _tools(body)
    tool_choice = _tool_choice(body, tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ProtocolError(f"parallel_tool_calls must be a boolean, got {parallel!r}",
                            param="parallel_tool_calls")
    logprobs = _bool(body, "logprobs", False)
    top_logprobs = _int(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise ProtocolError("top_logprobs requires logprobs=true", param="top_logprobs")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ProtocolError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    return ChatCompletionRequest(
        model=_model(body),
        messages=tuple(_message(m, i) for i, m in enumerate(messages)),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel is not False,
        sampling=_parse_sampling(body, default_max_tokens=None),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        chat_template_kwargs=dict(kwargs),
        return_token_ids=_bool(body, "return_token_ids", False),
        return_tokens_as_token_ids=_bool(body, "return_tokens_as_token_ids", False),
        session_id=_session_id(body),
    )


def check_prompt_tokens(
    tokens: Sequence[int], *, vocab_size: int, max_len: int, param: str = "prompt"
) -> None:
    """A prompt must be non-empty, in the vocabulary, and leave room for one generated token."""
    if not tokens:
        raise ProtocolError("the prompt is empty (it encodes to no tokens)", param=param)
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ProtocolError(
            f"token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})", param=param
        )
    if len(tokens) >= max_len:
        raise ProtocolError(
            f"the prompt has {len(tokens)} tokens, but this server's context is {max_len} tokens "
            f"and at least one must be left to generate",
            param=param,
        )


# ---------------------------------------------------------------- responses

WIRE_FINISH_REASONS = {"stop": "stop", "length": "length", "cache_full": "length",
                       "aborted": "abort"}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_label(token_id: int, text: str, *, as_token_id: bool) -> str:
    """How a token is spelled in logprobs: its text, or vLLM's "token_id:{id}"."""
    return f"token_id:{token_id}" if as_token_id else text


def completion_logprobs(
    labels: Sequence[str],
    logprobs: Sequence[float | None],
    top: Sequence[Sequence[tuple[str, float]] | None] | None,
    text_offset: Sequence[int],
) -> dict[str, Any]:
    """The legacy completions logprobs object. `top[i]` lists (label, logprob) alternatives at
    position i, the sampled token included (None: no alternatives asked for); `text_offset[i]` is
    where token i's text starts in the returned text. An echoed prompt's first token has None
    for both (nothing predicts it)."""
    return {
        "tokens": list(labels),
        "token_logprobs": [None if x is None else float(x) for x in logprobs],
        "top_logprobs": None if top is None else [None if alts is None else dict(alts)
                                                  for alts in top],
        "text_offset": list(text_offset),
    }


def chat_logprobs(
    labels: Sequence[str],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[str, float]]],
) -> dict[str, Any]:
    """The chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""

    def entry(label: str, logprob: float) -> dict[str, Any]:
        return {"token": label, "logprob": float(logprob), "bytes": list(label.encode("utf-8"))}

    return {
        "content": [
            {**entry(label, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
            for label, lp, alts in zip(labels, logprobs, top, strict=True)
        ]
    }


def sse_event(payload: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: `data: {json}` (or `data: [DONE]`) and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse_event("[DONE]")
