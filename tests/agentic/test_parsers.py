"""Tool-call parsers for the Qwen, Llama 3 and Gemma formats: round trips through the built-in
templates, several calls, text around calls, and malformed calls reported as errors, never raised."""

import pytest

from nonstop.agentic.parsers import get_parser, parse_tool_calls
from nonstop.models.chat import ChatTemplate, Message, ToolCall

FORMATS = ("qwen", "llama3", "gemma")
CALLS = (
    ToolCall(name="calculator", arguments={"expression": "12 + 35"}),
    ToolCall(name="search", arguments={"query": "capital of Varn", "k": 2}),
)
ASSISTANT_PREFIX = {
    "qwen": "<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<start_of_turn>model\n",
}
END = {"qwen": "<|im_end|>\n", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>\n"}


def rendered_turn(chat_format: str, content: str, calls) -> str:
    """The assistant text exactly as our template renders it (what a model trained on it emits)."""
    template = ChatTemplate.builtin(chat_format, special_tokens={"bos_token": ""})
    text = template.render([Message.user("hi"), Message.assistant(content, tool_calls=calls)])
    start = text.rindex(ASSISTANT_PREFIX[chat_format]) + len(ASSISTANT_PREFIX[chat_format])
    return text[start:]  # keeps the end-of-turn marker, as a decoder might


@pytest.mark.parametrize("chat_format", FORMATS)
@pytest.mark.parametrize("n_calls", [1, 2])
@pytest.mark.parametrize("content", ["", "Let me compute that."])
def test_round_trip_through_template(chat_format, n_calls, content):
    text = rendered_turn(chat_format, content, CALLS[:n_calls])
    assert END[chat_format].strip() in text
    turn = parse_tool_calls(text, chat_format)
    assert turn.errors == ()
    assert [(c.name, dict(c.arguments)) for c in turn.tool_calls] == [
        (c.name, c.arguments) for c in CALLS[:n_calls]
    ]
    assert [c.id for c in turn.tool_calls] == [f"call_{i}" for i in range(n_calls)]
    assert turn.content == content


@pytest.mark.parametrize("chat_format", FORMATS)
def test_plain_answer_has_no_calls(chat_format):
    turn = parse_tool_calls("The answer is {47}.", chat_format)
    assert turn.tool_calls == () and turn.errors == ()
    assert turn.content == "The answer is {47}."


WRAP = {
    "qwen": lambda body: f"<tool_call>\n{body}\n</tool_call>",
    "llama3": lambda body: body,
    "gemma": lambda body: f"```tool_call\n{body}\n```",
}


@pytest.mark.parametrize("chat_format", FORMATS)
def test_invalid_json_is_an_error_with_snippet(chat_format):
    bad = '{"name": "calculator", "arguments": {"expression": "1+1"'
    good = '{"name": "calculator", "arguments": {"expression": "2*3"}}'
    text = f"thinking\n{WRAP[chat_format](bad)}\n{WRAP[chat_format](good)}"
    turn = parse_tool_calls(text, chat_format)
    assert len(turn.errors) == 1
    assert turn.errors[0].kind == "invalid_json"
    assert '"expression": "1+1"' in turn.errors[0].snippet
    assert "Error:" in turn.errors[0].observation()
    assert [dict(c.arguments) for c in turn.tool_calls] == [{"expression": "2*3"}]
    assert turn.content.startswith("thinking")


@pytest.mark.parametrize("chat_format", FORMATS)
def test_missing_name_and_non_object_arguments(chat_format):
    if chat_format == "llama3":
        text = '{"parameters": {"x": 1}}\n{"name": "f", "parameters": [1, 2]}'
    else:
        text = WRAP[chat_format]('{"arguments": {"x": 1}}') + WRAP[chat_format](
            '{"name": "f", "arguments": [1, 2]}'
        )
    turn = parse_tool_calls(text, chat_format)
    assert turn.tool_calls == ()
    assert [e.kind for e in turn.errors] == ["missing_name", "bad_arguments"]


@pytest.mark.parametrize("chat_format", FORMATS)
def test_arguments_as_json_string(chat_format):
    body = '{"name": "calculator", "arguments": "{\\"expression\\": \\"7-2\\"}"}'
    turn = parse_tool_calls(WRAP[chat_format](body), chat_format)
    assert turn.errors == ()
    assert dict(turn.tool_calls[0].arguments) == {"expression": "7-2"}
    bad = '{"name": "calculator", "arguments": "{expression: 7-2}"}'
    turn = parse_tool_calls(WRAP[chat_format](bad), chat_format)
    assert turn.tool_calls == () and turn.errors[0].kind == "invalid_json"


@pytest.mark.parametrize("chat_format", ["qwen", "gemma"])
def test_unclosed_block_at_end_of_generation(chat_format):
    opened = {"qwen": "<tool_call>\n", "gemma": "```tool_call\n"}[chat_format]
    text = f'ok {opened}{{"name": "move", "arguments": {{"direction": "up"}}}}'
    turn = parse_tool_calls(text, chat_format)
    assert [(c.name, dict(c.arguments)) for c in turn.tool_calls] == [("move", {"direction": "up"})]
    assert turn.content == "ok"


def test_llama_python_tag_and_braces_in_prose():
    text = (
        'Sets like {1, 2} are fine.\n<|python_tag|>{"name": "search", "parameters": '
        '{"query": "x"}}<|eom_id|>'
    )
    turn = get_parser("llama3").parse(text)
    assert turn.errors == ()
    assert [(c.name, dict(c.arguments)) for c in turn.tool_calls] == [("search", {"query": "x"})]
    assert turn.content == "Sets like {1, 2} are fine."


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="chat_format must be one of"):
        get_parser("mistral")
