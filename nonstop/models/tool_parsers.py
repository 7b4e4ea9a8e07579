"""Tool-call parsers: an assistant's generated text → `ToolCall`s plus parse errors, never raising.

One parser per tool-call format, named as vLLM's `--tool-call-parser` names them:

- `hermes` (Qwen 2.5/3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
  The JSON object is decoded where it starts, so a `</tool_call>` inside a string argument
  does not end the call.
- `llama3_json` (Llama 3.1-3.3): one `{"name": ..., "parameters": {...}}` object per line,
  optionally after `<|python_tag|>`.
- `llama4_pythonic` (Llama 4, and Llama 3.2's pythonic form): a Python list of calls
  `[get_weather(city="Paris"), search(query="x", k=2)]`, optionally inside
  `<|python_start|>...<|python_end|>`; arguments are literals (JSON's true/false/null too).
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers) or
  `[TOOL_CALLS]name[ARGS]{...}` (v11 and later), any number of them.
- `deepseek_v3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n
  {...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`, and DeepSeek-V3.1's
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
- `gemma`: nonstop's Gemma template's fenced block ```` ```tool_call\\n{...}\\n``` ````.

A call cut off by the end of the generation is still parsed if its JSON is complete. A malformed
call (invalid JSON or Python, no name, arguments that are not an object) becomes a `ParseError`
with the offending snippet, which an environment shows the model as an observation. "arguments"
and "parameters" are accepted in every JSON format; arguments given as a JSON string are decoded.

`stream_split(text)` serves streaming: how much of a partial generation is plain content that
can be sent now, and whether a call has begun (the rest is held back until the end).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any, Literal, Protocol

from nonstop.models.chat import ToolCall

ParseErrorKind = Literal["invalid_json", "missing_name", "bad_arguments"]
_SNIPPET_CHARS = 200
# End-of-turn markers a decoder may leave in the text when special tokens are not skipped.
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|eot|>", "<end_of_turn>",
                "<|endoftext|>", "</s>", "<｜end▁of▁sentence｜>")


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


class ServingToolParser(ToolCallParser, Protocol):
    """What the server needs beyond `parse` (every parser here has both)."""

    def stream_split(self, text: str) -> tuple[int, bool]: ...

    def call_prefix(self, name: str | None) -> str: ...


def _snippet(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _SNIPPET_CHARS else text[:_SNIPPET_CHARS] + "..."


def _strip_end_markers(text: str) -> str:
    for marker in _END_MARKERS:
        text = text.replace(marker, "")
    return text


def _invalid(message: str, snippet: str) -> ParseError:
    return ParseError(kind="invalid_json", message=message, snippet=_snippet(snippet))


def call_from_object(obj: Any, *, snippet: str, index: int) -> ToolCall | ParseError:
    """A ToolCall from a decoded {"name", "arguments"|"parameters"} object, or why it is not one."""
    if not isinstance(obj, Mapping):
        return _invalid(f"a tool call must be a JSON object, got {type(obj).__name__}", snippet)
    return call_from_parts(obj.get("name"), obj.get("arguments", obj.get("parameters", {})),
                           snippet=snippet, index=index)


def call_from_parts(name: Any, arguments: Any, *, snippet: str, index: int
                    ) -> ToolCall | ParseError:
    """A ToolCall from a name and its arguments (an object, a JSON string or None)."""
    if not isinstance(name, str) or not name.strip():
        return ParseError(kind="missing_name", message='a tool call needs a non-empty string "name"',
                          snippet=_snippet(snippet))
    name = name.strip()
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return _invalid(f"the arguments of {name!r} are a string that is not valid JSON "
                            f"({error})", snippet)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        return ParseError(kind="bad_arguments",
                          message=f"the arguments of {name!r} must be a JSON object, got "
                                  f"{type(arguments).__name__}", snippet=_snippet(snippet))
    return ToolCall(name=name, arguments=dict(arguments), id=f"call_{index}")


def _collect(items: list[ToolCall | ParseError], content: str) -> ParsedTurn:
    return ParsedTurn(
        content=content.strip(),
        tool_calls=tuple(i for i in items if isinstance(i, ToolCall)),
        errors=tuple(i for i in items if isinstance(i, ParseError)),
    )


_DECODER = json.JSONDecoder()


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _decode_at(text: str, pos: int) -> tuple[Any, int]:
    """The JSON value starting at `pos` (after whitespace) and where it ends; raises
    json.JSONDecodeError."""
    return _DECODER.raw_decode(text, _skip_space(text, pos))


class _MarkerSplit:
    """`stream_split` for formats whose calls start at a fixed marker."""

    markers: tuple[str, ...] = ()

    def stream_split(self, text: str) -> tuple[int, bool]:
        """(n, started): text[:n] is content that can be sent now; `started` is whether a call
        has begun at n (everything from n on is held back until the generation ends)."""
        starts = [i for m in self.markers if (i := text.find(m)) >= 0]
        if starts:
            return min(starts), True
        hold = max((k for m in self.markers for k in range(1, len(m))
                    if text.endswith(m[:k])), default=0)
        return len(text) - hold, False


class HermesParser(_MarkerSplit):
    """`<tool_call>{json}</tool_call>` blocks (Qwen, Hermes); see the module docstring."""

    markers = ("<tool_call>",)
    _open, _close = "<tool_call>", "</tool_call>"
    _prefix = "<tool_call>\n"

    def call_prefix(self, name: str | None) -> str:
        """The opening of a call (to `name`, else to any function): what the server writes
        after the generation prompt for tool_choice "required" or a named function."""
        head = self._prefix + '{"name": "'
        return head if name is None else head + name + '", "arguments": '

    def parse(self, text: str) -> ParsedTurn:
        text = _strip_end_markers(text)
        items: list[ToolCall | ParseError] = []
        pieces, last = [], 0
        while (start := text.find(self._open, last)) >= 0:
            pieces.append(text[last:start])
            body = start + len(self._open)
            try:
                obj, end = _decode_at(text, body)
            except json.JSONDecodeError as error:
                close = text.find(self._close, body)
                end = len(text) if close < 0 else close
                items.append(_invalid(f"the tool call is not valid JSON ({error})", text[body:end]))
            else:
                items.append(call_from_object(obj, snippet=text[body:end], index=len(items)))
            end = _skip_space(text, end)
            if text.startswith(self._close, end):
                end += len(self._close)
            last = end
        pieces.append(text[last:])
        return _collect(items, "".join(pieces))


class GemmaParser(HermesParser):
    """nonstop's Gemma format: ```` ```tool_call\\n{json}\\n``` ```` blocks."""

    markers = ("```tool_call",)
    _open, _close = "```tool_call", "```"
    _prefix = "```tool_call\n"


class Llama3JsonParser:
    """JSON objects at the start of a line (after optional `<|python_tag|>`) with a "name",
    "parameters" or "arguments" key; other braces in the prose are left alone."""

    _start = re.compile(
        r'(?m)^[ \t]*(?:<\|python_tag\|>)?[ \t]*(?=\{\s*"(?:name|parameters|arguments)"\s*:)'
    )
    _python_tag = "<|python_tag|>"
    _maybe_start = re.compile(r"(?m)^[ \t]*(?:<\|python_tag\|>[ \t]*)?\{|<\|python_tag\|>")

    def parse(self, text: str) -> ParsedTurn:
        text = _strip_end_markers(text)
        items: list[ToolCall | ParseError] = []
        pieces, last = [], 0
        for match in self._start.finditer(text):
            if match.start() < last:
                continue
            brace = match.end()
            try:
                obj, end = _DECODER.raw_decode(text, brace)
            except json.JSONDecodeError as error:
                line_end = text.find("\n", brace)
                end = len(text) if line_end < 0 else line_end
                items.append(_invalid(f"the tool call is not valid JSON ({error})",
                                      text[brace:end]))
            else:
                items.append(call_from_object(obj, snippet=text[brace:end], index=len(items)))
            pieces.append(text[last : match.start()])
            last = end
        pieces.append(text[last:])
        return _collect(items, "".join(pieces).replace(self._python_tag, ""))

    def call_prefix(self, name: str | None) -> str:
        return '{"name": "' if name is None else '{"name": "' + name + '", "parameters": '

    def stream_split(self, text: str) -> tuple[int, bool]:
        match = self._maybe_start.search(text)
        if match is not None:
            return match.start(), True
        line_start = text.rfind("\n") + 1  # a line of blanks may still open a call
        tail = text[line_start:]
        if not tail.strip() or self._python_tag.startswith(tail.strip()):
            return line_start, False
        return len(text), False


class Llama4PythonicParser:
    """A Python list of calls, the whole turn: `[f(a=1), g(b="x")]` (see the module docstring)."""

    _open, _close = "<|python_start|>", "<|python_end|>"
    _literals = {"true": True, "false": False, "null": None}

    def parse(self, text: str) -> ParsedTurn:
        text = _strip_end_markers(text)
        body = text.replace(self._open, "").replace(self._close, "").strip()
        if not re.match(r"\[\s*[A-Za-z_][\w.]*\s*\(", body):
            return ParsedTurn(content=text.strip())
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError as error:
            return ParsedTurn(content="", errors=(_invalid(
                f"the tool calls are not a valid Python list of calls ({error.msg})", body),))
        if not isinstance(tree, ast.List):
            return ParsedTurn(content="", errors=(_invalid(
                "the tool calls must be one Python list of calls", body),))
        items: list[ToolCall | ParseError] = []
        for node in tree.elts:
            items.append(self._call(node, ast.get_source_segment(body, node) or body, len(items)))
        return _collect(items, "")

    def _call(self, node: ast.AST, snippet: str, index: int) -> ToolCall | ParseError:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute)):
            return _invalid("each element of the list must be a call name(arg=value, ...)",
                            snippet)
        if node.args:
            return ParseError(kind="bad_arguments", snippet=_snippet(snippet),
                              message="tool call arguments must be passed by keyword")
        name = ast.unparse(node.func)
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                return ParseError(kind="bad_arguments", snippet=_snippet(snippet),
                                  message="tool call arguments must be passed by keyword")
            try:
                arguments[keyword.arg] = self._literal(keyword.value)
            except ValueError as error:
                return ParseError(kind="bad_arguments", snippet=_snippet(snippet),
                                  message=f"argument {keyword.arg!r} of {name!r} is not a "
                                          f"literal ({error})")
        return call_from_parts(name, arguments, snippet=snippet, index=index)

    def _literal(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Name) and node.id in self._literals:
            return self._literals[node.id]
        if isinstance(node, ast.List):
            return [self._literal(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self._literal(k): self._literal(v)
                    for k, v in zip(node.keys, node.values, strict=True)}
        return ast.literal_eval(node)

    def call_prefix(self, name: str | None) -> str:
        return "[" if name is None else f"[{name}("

    def stream_split(self, text: str) -> tuple[int, bool]:
        stripped = text.lstrip()
        if stripped.startswith(("[", self._open)):
            return len(text) - len(stripped), True
        if not stripped or self._open.startswith(stripped):
            return len(text) - len(stripped), False
        return len(text), False


class MistralParser(_MarkerSplit):
    """`[TOOL_CALLS]` followed by a JSON list of calls, or by `name[ARGS]{json}`."""

    markers = ("[TOOL_CALLS]",)
    _marker, _args = "[TOOL_CALLS]", "[ARGS]"

    def call_prefix(self, name: str | None) -> str:
        head = '[TOOL_CALLS] [{"name": "'
        return head if name is None else head + name + '", "arguments": '

    def parse(self, text: str) -> ParsedTurn:
        text = _strip_end_markers(text)
        first = text.find(self._marker)
        if first < 0:
            return ParsedTurn(content=text.strip())
        items: list[ToolCall | ParseError] = []
        pos = first
        while (pos := text.find(self._marker, pos)) >= 0:
            pos += len(self._marker)
            body = _skip_space(text, pos)
            if text.startswith("[", body) or text.startswith("{", body):
                try:
                    obj, pos = _decode_at(text, body)
                except json.JSONDecodeError as error:
                    items.append(_invalid(f"the tool calls are not valid JSON ({error})",
                                          self._to_next(text, body)))
                    continue
                for call in obj if isinstance(obj, list) else [obj]:
                    items.append(call_from_object(call, snippet=json.dumps(call),
                                                  index=len(items)))
            else:
                args = text.find(self._args, body)
                next_marker = text.find(self._marker, body)
                if args < 0 or 0 <= next_marker < args:
                    items.append(_invalid("a call must be NAME[ARGS]{json} or a JSON list",
                                          self._to_next(text, body)))
                    continue
                name = text[body:args].split("[CALL_ID]")[0]
                try:
                    arguments, pos = _decode_at(text, args + len(self._args))
                except json.JSONDecodeError as error:
                    items.append(_invalid(f"the arguments of {name.strip()!r} are not valid "
                                          f"JSON ({error})", self._to_next(text, body)))
                    continue
                items.append(call_from_parts(name, arguments, snippet=text[body:pos],
                                             index=len(items)))
        return _collect(items, text[:first])

    def _to_next(self, text: str, pos: int) -> str:
        end = text.find(self._marker, pos)
        return text[pos:] if end < 0 else text[pos:end]


class DeepSeekV3Parser(_MarkerSplit):
    """DeepSeek-V3's (and V3.1's) tool-call tokens; see the module docstring."""

    _calls_begin, _calls_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    _begin, _sep, _end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    markers = (_calls_begin, _begin)

    def call_prefix(self, name: str | None) -> str:
        head = self._calls_begin + self._begin + "function" + self._sep
        return head if name is None else head + name + "\n```json\n"
    _fenced = re.compile(r"\s*(?:function)?\s*$")

    def parse(self, text: str) -> ParsedTurn:
        text = _strip_end_markers(text)
        starts = [i for m in self.markers if (i := text.find(m)) >= 0]
        if not starts:
            return ParsedTurn(content=text.strip())
        first = min(starts)
        items: list[ToolCall | ParseError] = []
        pos = first
        while (pos := text.find(self._begin, pos)) >= 0:
            pos += len(self._begin)
            end = text.find(self._end, pos)
            block = text[pos:] if end < 0 else text[pos:end]
            pos = len(text) if end < 0 else end + len(self._end)
            items.append(self._call(block, len(items)))
        return _collect(items, text[:first])

    def _call(self, block: str, index: int) -> ToolCall | ParseError:
        head, sep, rest = block.partition(self._sep)
        if not sep:
            return _invalid(f"a tool call needs {self._sep!r} between its type and name", block)
        if self._fenced.fullmatch(head):  # V3: function<sep>NAME\n```json\n{...}\n```
            name, _, rest = rest.partition("\n")
            rest = rest.strip()
            if rest.startswith("```"):
                rest = rest.removeprefix("```json").removeprefix("```").removesuffix("```")
        else:  # V3.1: NAME<sep>{...}
            name = head
        try:
            arguments, _ = _decode_at(rest, 0)
        except json.JSONDecodeError as error:
            return _invalid(f"the arguments of {name.strip()!r} are not valid JSON ({error})",
                            block)
        return call_from_parts(name, arguments, snippet=block, index=index)


_PARSERS: dict[str, type] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "llama4_pythonic": Llama4PythonicParser,
    "mistral": MistralParser,
    "deepseek_v3": DeepSeekV3Parser,
    "gemma": GemmaParser,
}
# nonstop's chat formats (chat_templates.CHAT_FORMATS) name the parser of their template.
_ALIASES = {"qwen": "hermes", "llama3": "llama3_json", "llama4": "llama4_pythonic"}
TOOL_PARSERS: tuple[str, ...] = tuple(_PARSERS)

# Tool-call syntax a chat template writes, in the order they are looked for.
_TEMPLATE_SIGNS = (
    ("<｜tool▁call▁begin｜>", "deepseek_v3"),
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
    ("```tool_call", "gemma"),
    ("<|header_start|>", "llama4_pythonic"),  # Llama 4's turn headers
    ('"parameters"', "llama3_json"),
)
_FAMILY_PARSERS = {"llama": "llama3_json", "qwen2": "hermes", "qwen3": "hermes", "gemma": "gemma",
                   "gemma2": "gemma", "gemma3": "gemma"}


def get_parser(name: str) -> ServingToolParser:
    """The parser named `name` (TOOL_PARSERS, or a chat format: "qwen", "llama3", "gemma")."""
    key = _ALIASES.get(name, name)
    if key not in _PARSERS:
        raise ValueError(f"tool parser must be one of {TOOL_PARSERS} (or a chat format "
                         f"{tuple(_ALIASES)}), got {name!r}")
    return _PARSERS[key]()


def parser_name_for(chat_template: str | None, family: str | None) -> str | None:
    """The parser a checkpoint's tool calls need: read from the tool-call syntax its chat
    template writes, else from its model family; None if neither says."""
    for sign, name in _TEMPLATE_SIGNS:
        if chat_template is not None and sign in chat_template:
            return name
    return _FAMILY_PARSERS.get(family or "")


def parse_tool_calls(text: str, parser: str) -> ParsedTurn:
    """Parse one assistant turn with the parser named `parser` (see `get_parser`)."""
    return get_parser(parser).parse(text)


# The earlier names.
QwenParser = HermesParser
Llama3Parser = Llama3JsonParser

__all__ = ["TOOL_PARSERS", "DeepSeekV3Parser", "GemmaParser", "HermesParser", "Llama3JsonParser",
           "Llama3Parser", "Llama4PythonicParser", "MistralParser", "ParseError", "ParsedTurn",
           "QwenParser", "ServingToolParser", "ToolCallParser", "call_from_object", "call_from_parts", "get_parser",
           "parse_tool_calls", "parser_name_for"]
