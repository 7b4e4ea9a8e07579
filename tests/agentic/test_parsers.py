"""Tool-call parsers for every format: calls rendered by each family's chat template come back
whole, malformed calls are errors (never exceptions, on any prefix of a turn), streaming splits
never send call text as content, and the same turns drive a real environment through the agent's
path (AgentAction.from_text -> env.step)."""

import asyncio
import json

import pytest

from nonstop.agentic.environment import AgentAction
from nonstop.agentic.envs import CalculatorConfig, CalculatorEnv
from nonstop.agentic.parsers import TOOL_PARSERS, get_parser, parse_tool_calls, parser_name_for
from nonstop.models.chat import ChatTemplate, Message, ToolCall
from nonstop.models.chat_templates import BUILTIN_TEMPLATES

CALLS = (
    ToolCall(name="calculator", arguments={"expression": "12 + 35"}),
    ToolCall(name="search", arguments={"query": "capital of Varn", "k": 2, "exact": True}),
)

# The assistant turn of each family's published template, written in its layout (Mistral's v3
# tokenizer template, DeepSeek-V3's, vLLM's Llama 4 pythonic example); nonstop's built-in ones
# for the other three.
_ARGS = "{%- set fn = tool_call.function %}{%- set args = fn.arguments if fn.arguments is " \
        "string else fn.arguments | tojson %}"
MISTRAL_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}{{- '[INST] ' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' %}
        {%- if message.tool_calls %}
            {{- message.content + '[TOOL_CALLS] [' }}
            {%- for tool_call in message.tool_calls %}
                {%- set out = tool_call.function | tojson %}
                {{- out[:-1] + ', "id": "' + tool_call.id + '"}' }}
                {%- if not loop.last %}{{- ', ' }}{%- endif %}
            {%- endfor %}
            {{- ']' + eos_token }}
        {%- else %}{{- message.content + eos_token }}{%- endif %}
    {%- endif %}
{%- endfor %}"""
DEEPSEEK_V3_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}{{- '<｜User｜>' + message.content }}
    {%- elif message.role == 'assistant' %}
        {{- '<｜Assistant｜>' + message.content }}
        {%- for tool_call in message.tool_calls or [] %}""" + _ARGS + """
            {%- if loop.first %}{{- '<｜tool▁calls▁begin｜>' }}{%- else %}{{- '\\n' }}{%- endif %}
            {{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + fn.name + '\\n```json\\n'
                + args + '\\n```<｜tool▁call▁end｜>' }}
            {%- if loop.last %}{{- '<｜tool▁calls▁end｜>' }}{%- endif %}
        {%- endfor %}
        {{- '<｜end▁of▁sentence｜>' }}
    {%- endif %}
{%- endfor %}"""
LLAMA4_PYTHONIC_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {{- '<|header_start|>' + message.role + '<|header_end|>\\n\\n' }}
    {%- if message.tool_calls %}
        {{- '[' }}
        {%- for tool_call in message.tool_calls %}
            {{- tool_call.function.name + '(' }}
            {%- for name, value in tool_call.function.arguments.items() %}
                {{- name + '=' + value | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
            {%- endfor %}
            {{- ')' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' }}
    {%- else %}{{- message.content }}{%- endif %}
    {{- '<|eot|>' }}
{%- endfor %}"""

TEMPLATES = {
    "hermes": (BUILTIN_TEMPLATES["qwen"], "<|im_start|>assistant\n"),
    "llama3_json": (BUILTIN_TEMPLATES["llama3"], "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "gemma": (BUILTIN_TEMPLATES["gemma"], "<start_of_turn>model\n"),
    "mistral": (MISTRAL_TEMPLATE, "[/INST]"),
    "deepseek_v3": (DEEPSEEK_V3_TEMPLATE, "<｜Assistant｜>"),
    "llama4_pythonic": (LLAMA4_PYTHONIC_TEMPLATE, "<|header_start|>assistant<|header_end|>\n\n"),
}
SPECIALS = {"bos_token": "", "eos_token": "</s>"}
NO_CONTENT_WITH_CALLS = {"llama4_pythonic"}  # the call list is the whole turn


def rendered_turn(parser: str, content: str, calls) -> str:
    """The assistant text exactly as the family's template renders it (what a model trained on it
    emits), its end-of-turn marker kept as a decoder might."""
    source, prefix = TEMPLATES[parser]
    calls = [ToolCall(name=c.name, arguments=c.arguments, id=f"abcdefgh{i}")
             for i, c in enumerate(calls)]
    text = ChatTemplate(source, special_tokens=SPECIALS).render(
        [Message.user("hi"), Message.assistant(content, tool_calls=calls)])
    return text[text.rindex(prefix) + len(prefix):]


def test_every_parser_has_a_template():
    assert set(TEMPLATES) == set(TOOL_PARSERS)


@pytest.mark.parametrize("parser", TOOL_PARSERS)
@pytest.mark.parametrize("n_calls", [1, 2])
@pytest.mark.parametrize("content", ["", "Let me compute that."])
def test_round_trip_through_template(parser, n_calls, content):
    if content and parser in NO_CONTENT_WITH_CALLS:
        pytest.skip("the pythonic format has no prose beside its calls")
    text = rendered_turn(parser, content, CALLS[:n_calls])
    turn = parse_tool_calls(text, parser)
    assert turn.errors == ()
    assert [(c.name, dict(c.arguments)) for c in turn.tool_calls] == [
        (c.name, c.arguments) for c in CALLS[:n_calls]
    ]
    assert [c.id for c in turn.tool_calls] == [f"call_{i}" for i in range(n_calls)]
    assert turn.content == content


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_plain_answer_has_no_calls(parser):
    turn = parse_tool_calls("The answer is {47}.", parser)
    assert turn.tool_calls == () and turn.errors == ()
    assert turn.content == "The answer is {47}."


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_no_prefix_of_a_turn_raises(parser):
    """Every cut of a rendered turn (a generation stopped anywhere) parses without raising, and
    the content streamed before a call never holds the call's text."""
    text = rendered_turn(parser, "" if parser in NO_CONTENT_WITH_CALLS else "Sure.", CALLS)
    p = get_parser(parser)
    for end in range(len(text) + 1):
        turn = p.parse(text[:end])
        assert all(e.observation().startswith("Error: ") for e in turn.errors)
        n, _ = p.stream_split(text[:end])
        assert "calculator" not in text[:n] and n <= end
    assert p.stream_split(text)[1]  # the call has begun


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_the_forced_call_opening_is_what_the_template_writes(parser):
    """tool_choice "required" / named: the server writes call_prefix after the generation
    prompt; the family's own rendering of a call starts with it."""
    p = get_parser(parser)
    text = rendered_turn(parser, "", [CALLS[0]])
    assert text.startswith(p.call_prefix("calculator"))
    assert p.call_prefix("calculator").startswith(p.call_prefix(None))
    assert p.parse(text).tool_calls[0].name == "calculator"


# Malformed calls in each format: (text, error kinds, calls still read).
BAD = "{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1+1\""
GOOD = "{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2*3\"}}"
MALFORMED = {
    "hermes": [(f"thinking\n<tool_call>\n{BAD}\n</tool_call>\n<tool_call>\n{GOOD}\n</tool_call>",
                ["invalid_json"], 1),
               ('<tool_call>{"arguments": {"x": 1}}</tool_call><tool_call>{"name": "f", '
                '"arguments": [1]}</tool_call>', ["missing_name", "bad_arguments"], 0)],
    "gemma": [(f"thinking\n```tool_call\n{BAD}\n```\n```tool_call\n{GOOD}\n```", ["invalid_json"],
               1)],
    "llama3_json": [(f"thinking\n{BAD}\n{GOOD}", ["invalid_json"], 1),
                    ('{"parameters": {"x": 1}}\n{"name": "f", "parameters": [1, 2]}',
                     ["missing_name", "bad_arguments"], 0)],
    "mistral": [(f"thinking[TOOL_CALLS] [{BAD}][TOOL_CALLS] [{GOOD}]", ["invalid_json"], 1),
                ('[TOOL_CALLS]calculator[ARGS]{"expression": }', ["invalid_json"], 0),
                ("thinking[TOOL_CALLS]calculator", ["invalid_json"], 0)],
    "deepseek_v3": [("thinking<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                     "calculator\n```json\n{\"expression\": \n```<｜tool▁call▁end｜>"
                     "<｜tool▁call▁begin｜>calculator<｜tool▁sep｜>{\"expression\": \"2*3\"}"
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", ["invalid_json"], 1),
                    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator", ["invalid_json"], 0)],
    "llama4_pythonic": [('[calculator(expression="1+1"', ["invalid_json"], 0),
                        ('[calculator("1+1"), search(query=x)]',
                         ["bad_arguments", "bad_arguments"], 0)],
}


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_malformed_calls_are_errors_with_snippets(parser):
    for text, kinds, good in MALFORMED[parser]:
        turn = parse_tool_calls(text, parser)
        assert [e.kind for e in turn.errors] == kinds, text
        assert all(e.snippet and e.observation().startswith("Error: ") for e in turn.errors)
        assert len(turn.tool_calls) == good, text
        if good:
            assert [dict(c.arguments) for c in turn.tool_calls] == [{"expression": "2*3"}]
            assert turn.content.startswith("thinking")


def test_hermes_reads_the_json_object_not_up_to_the_first_closing_tag():
    call = {"name": "write", "arguments": {"text": "a </tool_call> b", "n": 1}}
    text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>after"
    turn = parse_tool_calls(text, "hermes")
    assert turn.errors == () and turn.content == "after"
    assert dict(turn.tool_calls[0].arguments) == call["arguments"]


@pytest.mark.parametrize("parser", ["hermes", "gemma", "llama3_json"])
def test_arguments_as_json_string(parser):
    wrap = {"hermes": "<tool_call>\n{}\n</tool_call>", "gemma": "```tool_call\n{}\n```",
            "llama3_json": "{}"}[parser]
    body = '{"name": "calculator", "arguments": "{\\"expression\\": \\"7-2\\"}"}'
    turn = parse_tool_calls(wrap.format(body), parser)
    assert turn.errors == () and dict(turn.tool_calls[0].arguments) == {"expression": "7-2"}
    bad = '{"name": "calculator", "arguments": "{expression: 7-2}"}'
    turn = parse_tool_calls(wrap.format(bad), parser)
    assert turn.tool_calls == () and turn.errors[0].kind == "invalid_json"


def test_mistral_v11_and_pythonic_literals():
    turn = parse_tool_calls('ok[TOOL_CALLS]search[ARGS]{"query": "x"}[TOOL_CALLS]calculator'
                            '[ARGS]{"expression": "1"}</s>', "mistral")
    assert [(c.name, dict(c.arguments)) for c in turn.tool_calls] == [
        ("search", {"query": "x"}), ("calculator", {"expression": "1"})]
    assert turn.content == "ok"
    turn = parse_tool_calls('<|python_start|>[f(a=true, b=null, c=[1, {"d": 2.5}], e=False)]'
                            "<|python_end|>", "llama4_pythonic")
    assert dict(turn.tool_calls[0].arguments) == {"a": True, "b": None, "c": [1, {"d": 2.5}],
                                                  "e": False}


def test_llama_python_tag_and_braces_in_prose():
    text = ('Sets like {1, 2} are fine.\n<|python_tag|>{"name": "search", "parameters": '
            '{"query": "x"}}<|eom_id|>')
    turn = get_parser("llama3").parse(text)
    assert turn.errors == ()
    assert [(c.name, dict(c.arguments)) for c in turn.tool_calls] == [("search", {"query": "x"})]
    assert turn.content == "Sets like {1, 2} are fine."


def test_parser_is_chosen_by_template_then_family_and_unknown_names_are_refused():
    assert {p: parser_name_for(TEMPLATES[p][0], None) for p in TOOL_PARSERS} == {
        p: p for p in TOOL_PARSERS}
    assert parser_name_for("{{ messages }}", "qwen3") == "hermes"
    assert parser_name_for(None, "gemma3") == "gemma" and parser_name_for(None, None) is None
    assert type(get_parser("qwen")) is type(get_parser("hermes"))
    with pytest.raises(ValueError, match="tool parser must be one of"):
        get_parser("nonsense")


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_the_agent_path_runs_parsed_calls_and_shows_errors(parser):
    """The turn the family's template renders drives a real CalculatorEnv: the call runs and its
    result is the answer; a malformed one comes back as an error observation, not an exception."""

    async def main():
        env = CalculatorEnv(CalculatorConfig(num_steps=1))  # the whole problem in one call
        task = env.sample_task(5)
        await env.reset(task)
        p = get_parser(parser)
        call = ToolCall(name="calculator", arguments={"expression": task.info["expression"]})
        good = await env.step(AgentAction.from_text(rendered_turn(parser, "", [call]), p))
        bad_text, kinds, _ = MALFORMED[parser][-1]
        bad = await env.step(AgentAction.from_text(bad_text, p))
        return task, good, bad, kinds

    task, good, bad, kinds = asyncio.run(main())
    assert good.messages[0].content == task.answer and good.messages[0].tool_call_id == "call_0"
    errors = [m for m in bad.messages if m.content.startswith("Error: ")]
    assert not bad.done and len(errors) == len(kinds)
    assert bad.info["tool_errors"] == kinds
