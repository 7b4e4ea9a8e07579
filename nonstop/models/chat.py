"""Chat messages, tool schemas and Jinja chat-template rendering with transformers' semantics.

`ChatTemplate(source).render(messages, tools=..., add_generation_prompt=...)` returns the same
string as transformers' `tokenizer.apply_chat_template(messages, tools=..., tokenize=False, ...)`:
the same sandboxed Jinja environment (trim_blocks, lstrip_blocks, loopcontrols, a `{% generation %}`
tag), the same globals (`raise_exception`, `strftime_now`, `namespace`, `dict`) and `tojson` filter,
the same variables (messages, tools, documents, add_generation_prompt, the tokenizer's named special
tokens, extra variables such as enable_thinking), and the same message normalization (None-valued
keys dropped, reasoning fields aliased).

Where it departs from transformers: values that are not plain JSON data (images, arrays, arbitrary
objects) are refused with a TypeError instead of being replaced by a placeholder string, tools must
be JSON schemas (not Python functions), and continue_final_message is not offered.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, get_args

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nonstop.models.chat_templates import BUILTIN_TEMPLATES, CHAT_FORMATS, ChatFormat
from nonstop.models.tokenizer import Tokenizer

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = get_args(Role)
# A tool schema in the OpenAI function format:
# {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
ToolSchema = Mapping[str, Any]

# Variables the renderer itself sets; extra variables may not shadow them.
_RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One function call made by the assistant; `arguments` is a JSON object or a JSON string."""

    name: str
    arguments: Mapping[str, Any] | str = dataclasses.field(default_factory=dict)
    id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ToolCall.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.arguments, (Mapping, str)):
            raise ValueError(
                f"ToolCall.arguments must be a mapping or a JSON string, got "
                f"{type(self.arguments).__name__}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI / transformers form: {"type": "function", "function": {name, arguments}}."""
        arguments = self.arguments if isinstance(self.arguments, str) else dict(self.arguments)
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }
        if self.id is not None:
            call["id"] = self.id
        return call


@dataclasses.dataclass(frozen=True, kw_only=True)
class Message:
    """One chat message. Tool calls only on assistant messages; tool_call_id/name only on tool
    results."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Message.role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise ValueError(f"Message.content must be a string, got {type(self.content).__name__}")
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))
        if self.tool_calls and self.role != "assistant":
            raise ValueError(
                f"Message.tool_calls is only valid on assistant messages, not {self.role}"
            )
        if not all(isinstance(call, ToolCall) for call in self.tool_calls):
            raise ValueError("Message.tool_calls must hold ToolCall objects")
        if (self.tool_call_id is not None or self.name is not None) and self.role != "tool":
            raise ValueError(
                f"Message.tool_call_id and Message.name are only valid on tool messages, "
                f"not {self.role}"
            )

    @classmethod
    def system(cls, content: str) -> Message:
        return cls(role="system", content=content)

    @classmethod
    def user(cls, content: str) -> Message:
        return cls(role="user", content=content)

    @classmethod
    def assistant(cls, content: str = "", *, tool_calls: Sequence[ToolCall] = ()) -> Message:
        return cls(role="assistant", content=content, tool_calls=tuple(tool_calls))

    @classmethod
    def tool(
        cls, content: str, *, tool_call_id: str | None = None, name: str | None = None
    ) -> Message:
        return cls(role="tool", content=content, tool_call_id=tool_call_id, name=name)

    def to_dict(self) -> dict[str, Any]:
        """The dict a chat template sees (transformers' message format); unset fields are absent."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        for key in ("tool_call_id", "name", "reasoning_content"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


def validate_tool_schema(schema: ToolSchema, *, index: int = 0) -> dict[str, Any]:
    """Check one tool schema is in the OpenAI function format and return it as a plain dict."""
    function = schema.get("function") if isinstance(schema, Mapping) else None
    if (
        not isinstance(schema, Mapping)
        or schema.get("type") != "function"
        or not isinstance(function, Mapping)
    ):
        raise ValueError(
            f"tools[{index}] must be {{'type': 'function', 'function': {{'name': ..., "
            f"'description': ..., 'parameters': {{...}}}}}}, got {schema!r}"
        )
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"tools[{index}].function.name must be a non-empty string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise ValueError(f"tools[{index}].function.parameters must be a JSON-schema object")
    return _plain(schema, where=f"tools[{index}]")


def _plain(value: Any, *, where: str) -> Any:
    """Rebuild `value` from plain JSON types, so the sandbox only ever sees data."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (enums, numpy floats) back to the base type, so no extra methods reach the sandbox.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item(), where=where)
    if isinstance(value, Mapping):
        return {_plain(k, where=where): _plain(v, where=f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, where=f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_plain(v, where=f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, (Message, ToolCall)):
        return _plain(value.to_dict(), where=where)
    raise TypeError(
        f"{where}: a chat template can only be given JSON data (str, numbers, bools, None, "
        f"lists, dicts), got {type(value).__name__}"
    )


def normalize_message(message: Message | Mapping[str, Any], index: int) -> dict[str, Any]:
    """The dict a template sees for `message`, as transformers prepares it: None-valued keys
    dropped, plain JSON data only, reasoning aliased under reasoning_content and thinking."""
    if isinstance(message, Message):
        message = message.to_dict()
    if not isinstance(message, Mapping):
        raise TypeError(
            f"messages[{index}] must be a Message or a dict, got {type(message).__name__}"
        )
    plain = _plain({k: v for k, v in message.items() if v is not None}, where=f"messages[{index}]")
    reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it to mark
    assistant text; nonstop marks assistant tokens in Conversation instead)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names (no path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        for name in dict(*args, **kwargs):
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
            )


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without exposing the dict type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    try:
        return environment.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ValueError(
            f"chat template is not valid Jinja: {error.message} (line {error.lineno})"
        ) from error


class ChatTemplate:
    """A compiled Jinja chat template plus the special tokens its tokenizer exposes to it."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str] | None = None):
        if not isinstance(source, str) or not source:
            raise ValueError("ChatTemplate source must be a non-empty Jinja string")
        self._source = source
        self._template = _compile(source)
        self._special_tokens = dict(special_tokens or {})

    @classmethod
    def builtin(
        cls, chat_format: ChatFormat, *, special_tokens: Mapping[str, str] | None = None
    ) -> ChatTemplate:
        """nonstop's template for a family: "llama3", "qwen" or "gemma"."""
        if chat_format not in BUILTIN_TEMPLATES:
            raise ValueError(f"chat_format must be one of {CHAT_FORMATS}, got {chat_format!r}")
        return cls(BUILTIN_TEMPLATES[chat_format], special_tokens=special_tokens)

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Tokenizer, *, name: str | None = None, tools: bool = False
    ) -> ChatTemplate:
        """The checkpoint's own template, chosen as transformers chooses it (see
        Tokenizer.get_chat_template), with the tokenizer's special tokens."""
        return cls(
            tokenizer.get_chat_template(name, tools=tools), special_tokens=tokenizer.special_tokens
        )

    @property
    def source(self) -> str:
        return self._source

    @property
    def special_tokens(self) -> dict[str, str]:
        return dict(self._special_tokens)

    def render(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        tools: Sequence[ToolSchema] | None = None,
        add_generation_prompt: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as text, exactly as transformers' apply_chat_template(tokenize=False).

        `variables` are further template variables (e.g. {"enable_thinking": False}); they override
        the special tokens of the same name, as keyword arguments do in transformers.
        """
        normalized = [normalize_message(message, i) for i, message in enumerate(messages)]
        tool_schemas = (
            None
            if tools is None
            else [validate_tool_schema(t, index=i) for i, t in enumerate(tools)]
        )
        variables = dict(variables or {})
        if shadowed := _RESERVED_VARIABLES & variables.keys():
            raise ValueError(
                f"variables may not set {sorted(shadowed)}: pass messages, tools and "
                f"add_generation_prompt as arguments"
            )
        context = {**self._special_tokens, **_plain(variables, where="variables")}
        return self._template.render(
            messages=normalized,
            tools=tool_schemas,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **context,
        )

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self._source)} chars, special_tokens={sorted(self._special_tokens)})"
