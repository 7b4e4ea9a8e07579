"""Tool-call parsers: the assistant's generated text → ToolCalls plus parse errors, never raising.

Each parser reads the format its built-in chat template renders (nonstop/models/chat_templates.py),
so a parsed turn re-rendered by that template gives the same calls back:

- Qwen:    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number of them.
- Llama 3: one JSON object `{"name": ..., "parameters": {...}}` per line, optionally after
  `<|python_tag|>` (Llama 3.1's own prefix for tool calls).
- Gemma:   a fenced block ```` ```tool_call\\n{"name": ..., "arguments": {...}}\\n``` ````.

A block that opens but never closes (generation stopped at the closing tag or at max_tokens) is
still parsed. A malformed call (invalid JSON, no name, arguments that are not an object) becomes a
`ParseError` with the offending snippet; the environment turns it into an observation the model
sees. "arguments" and "parameters" are accepted in every format; arguments given as a JSON string
are decoded.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any, Literal, Protocol

from nonstop.models.chat import ToolCall
from nonstop.models.chat_templates import CHAT_FORMATS, ChatFormat

ParseErrorKind = Literal["invalid_json", "missing_name", "bad_arguments"]
_SNIPPET_CHARS = 200
# End-of-turn markers a decoder may leave in the text when special tokens are not skipped.
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|endoftext|>")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParseError:
    """A tool call the model tried to make but got wrong; `snippet` is the offending text."""

    kind: ParseErrorKind
    message: str
    snippet: str

    def observation(self) -> str:
        """The text the model sees in place of a tool result."""
        return f"Error: {self.message}. Offending text: {self.snippet}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParsedTurn:
    """An assistant turn split into its prose (`content`), its tool calls and its parse errors."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    errors: tuple[ParseError, ...] = ()


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


def _snippet(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _SNIPPET_CHARS else text[:_SNIPPET_CHARS] + "..."


def _strip_end_markers(text: str) -> str:
    for marker in _END_MARKERS:
        text = text.replace(marker, "")
    return text


def call_from_object(obj: Any, *, snippet: str, index: int) -> ToolCall | ParseError:
    """A ToolCall from a decoded {"name", "arguments"|"parameters"} object, or why it is not one."""
    if not isinstance(obj, Mapping):
        return ParseError(
            kind="invalid_json",
            message=f"a tool call must be a JSON object, got {type(obj).__name__}",
            snippet=_snippet(snippet),
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParseError(
            kind="missing_name",
            message='a tool call needs a non-empty string "name"',
            snippet=_snippet(snippet),
        )
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return ParseError(
                kind="invalid_json",
                message=f"the arguments of {name!r} are a string that is not valid JSON ({error})",
                snippet=_snippet(snippet),
            )
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        return ParseError(
            kind="bad_arguments",
            message=f"the arguments of {name!r} must be a JSON object, got "
            f"{type(arguments).__name__}",
            snippet=_snippet(snippet),
        )
    return ToolCall(name=name, arguments=dict(arguments), id=f"call_{index}")


def _decode_body(body: str, index: int) -> ToolCall | ParseError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as error:
        return ParseError(
            kind="invalid_json", message=f"the tool call is not valid JSON ({error})",
            snippet=_snippet(body),
        )  # fmt: skip
    return call_from_object(obj, snippet=body, index=index)


def _collect(items: list[ToolCall | ParseError], content: str) -> ParsedTurn:
    return ParsedTurn(
        content=content.strip(),
        tool_calls=tuple(i for i in items if isinstance(i, ToolCall)),
        errors=tuple(i for i in items if isinstance(i, ParseError)),
    )


class _BlockParser:
    """Calls delimited by an opening and a closing marker (Qwen's tags, Gemma's fences)."""

    def __init__(self, open_pattern: str, close_pattern: str):
        self._block = re.compile(rf"{open_pattern}(.*?)(?:{close_pattern}|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        text = _strip_end_markers(text)
        items: list[ToolCall | ParseError] = []
        pieces, last = [], 0
        for match in self._block.finditer(text):
            pieces.append(text[last : match.start()])
            last = match.end()
            items.append(_decode_body(match.group(1).strip(), len(items)))
        pieces.append(text[last:])
        return _collect(items, "".join(pieces))


class QwenParser(_BlockParser):
    def __init__(self) -> None:
        super().__init__(r"<tool_call>", r"</tool_call>")


class GemmaParser(_BlockParser):
    def __init__(self) -> None:
        super().__init__(r"```tool_call[ \t]*\n?", r"\n?```")


class Llama3Parser:
    """JSON objects at the start of a line (after optional `<|python_tag|>`) with a "name",
    "parameters" or "arguments" key; other braces in the prose are left alone."""

    _start = re.compile(
        r'(?m)^[ \t]*(?:<\|python_tag\|>)?[ \t]*(?=\{\s*"(?:name|parameters|arguments)"\s*:)'
    )
    _python_tag = "<|python_tag|>"

    def parse(self, text: str) -> ParsedTurn:
        text = _strip_end_markers(text)
        items: list[ToolCall | ParseError] = []
        pieces, last = [], 0
        decoder = json.JSONDecoder()
        for match in self._start.finditer(text):
            if match.start() < last:
                continue
            brace = match.end()
            try:
                obj, end = decoder.raw_decode(text, brace)
            except json.JSONDecodeError as error:
                line_end = text.find("\n", brace)
                end = len(text) if line_end < 0 else line_end
                items.append(ParseError(
                    kind="invalid_json", message=f"the tool call is not valid JSON ({error})",
                    snippet=_snippet(text[brace:end]),
                ))  # fmt: skip
            else:
                items.append(call_from_object(obj, snippet=text[brace:end], index=len(items)))
            pieces.append(text[last : match.start()])
            last = end
        pieces.append(text[last:])
        return _collect(items, "".join(pieces).replace(self._python_tag, ""))


_PARSERS: dict[ChatFormat, type] = {
    "qwen": QwenParser,
    "llama3": Llama3Parser,
    "gemma": GemmaParser,
}


def get_parser(chat_format: ChatFormat) -> ToolCallParser:
    """The parser for a built-in chat format: "qwen", "llama3" or "gemma"."""
    if chat_format not in _PARSERS:
        raise ValueError(f"chat_format must be one of {CHAT_FORMATS}, got {chat_format!r}")
    return _PARSERS[chat_format]()


def parse_tool_calls(text: str, chat_format: ChatFormat) -> ParsedTurn:
    """Parse one assistant turn of `chat_format`."""
    return get_parser(chat_format).parse(text)
