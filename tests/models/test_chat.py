"""Chat rendering: equal to transformers' apply_chat_template(tokenize=False) for the built-in
templates and for a checkpoint's own template, with tool schemas, tool calls and tool results."""

from __future__ import annotations

import json
import shutil

import jinja2
import pytest
from transformers import AutoTokenizer

from nonstop.models.chat import ChatTemplate, Message, ToolCall, normalize_message
from nonstop.models.tokenizer import Tokenizer
from tests.models.tokenizer_fixtures import build_tiny_tokenizer

FAMILIES = ("llama3", "qwen", "gemma")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {}}},
]

CONVERSATIONS: dict[str, list[dict]] = {
    "plain": [
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Say 42."},
    ],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in “quotes” 🙂"},
    ],
    "tools": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Zürich and the time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "id": "c1",
                    "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
                },
                {"type": "function", "id": "c2", "function": {"name": "now", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "c2", "name": "now", "content": "12:00"},
        {"role": "assistant", "content": "It is 21°C at 12:00."},
        {"role": "user", "content": "Thanks."},
    ],
    "call_with_text": [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "content": "cold"},
    ],
}


@pytest.fixture(scope="module", params=FAMILIES)
def family_pair(request, tmp_path_factory):
    path = build_tiny_tokenizer(tmp_path_factory.mktemp(request.param), request.param)
    return Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_builtin_templates_match_transformers(family_pair, name, with_tools, add_generation_prompt):
    ours, theirs = family_pair
    messages = CONVERSATIONS[name]
    tools = TOOLS if with_tools else None
    expected = theirs.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    template = ChatTemplate.from_tokenizer(ours, tools=with_tools)
    rendered = template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    # Every message and every tool schema shows up in the text.
    for message in messages:
        if isinstance(message["content"], str):
            assert message["content"] in rendered
    if with_tools and messages:
        assert '"get_weather"' in rendered and "Zürich" in rendered


def test_builtin_formats_by_hand():
    """The exact text of each format for a short tool-using chat, worked out by hand."""
    messages = [
        Message.system("S"),
        Message.user("U"),
        Message.assistant(tool_calls=[ToolCall(name="f", arguments={"x": 1})]),
        Message.tool("R1"),
        Message.tool("R2"),
        Message.assistant("A"),
    ]
    special = {"bos_token": "<B>"}
    llama = ChatTemplate.builtin("llama3", special_tokens=special).render(messages)
    assert llama == (
        "<B><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "f", "parameters": {"x": 1}}'
        "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\nR1<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\nR2<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>"
    )
    qwen = ChatTemplate.builtin("qwen").render(messages, add_generation_prompt=True)
    assert qwen == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nR1\n</tool_response>\n<tool_response>\nR2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n<|im_start|>assistant\n"
    )
    gemma = ChatTemplate.builtin("gemma", special_tokens=special).render(messages)
    assert gemma == (
        "<B><start_of_turn>user\nS\n\nU<end_of_turn>\n"
        '<start_of_turn>model\n```tool_call\n{"name": "f", "arguments": {"x": 1}}\n```'
        "<end_of_turn>\n<start_of_turn>user\n```tool_output\nR1\n```\n```tool_output\nR2\n```"
        "<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
    )


def test_message_objects_render_like_dicts():
    messages = [
        Message.system("Use tools when useful."),
        Message.user("Weather in Zürich and the time?"),
        Message.assistant(
            tool_calls=[
                ToolCall(name="get_weather", arguments={"city": "Zürich"}, id="c1"),
                ToolCall(name="now", arguments="{}", id="c2"),
            ]
        ),
        Message.tool('{"temp": 21}', tool_call_id="c1", name="get_weather"),
        Message.tool("12:00", tool_call_id="c2", name="now"),
        Message.assistant("It is 21°C at 12:00."),
        Message.user("Thanks."),
    ]
    assert [normalize_message(m, i) for i, m in enumerate(messages)] == [
        normalize_message(m, i) for i, m in enumerate(CONVERSATIONS["tools"])
    ]
    for family in FAMILIES:
        template = ChatTemplate.builtin(family, special_tokens={"bos_token": "<s>"})
        assert template.render(messages, tools=TOOLS) == template.render(
            CONVERSATIONS["tools"], tools=TOOLS
        )


# A checkpoint's own template that leans on everything transformers offers a template.
CUSTOM_TEMPLATE = """\
{%- set ns = namespace(turns=0) -%}
{{ bos_token }}[year:{{ strftime_now('%Y') | length }}]
{%- if tools %}<tools>{{ tools | tojson(indent=2, sort_keys=True) }}</tools>{% endif %}
{% for message in messages %}
  {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
    {{- raise_exception('bad role ' + message.role) }}
  {%- endif %}
  {%- if message.role == 'system' %}{% continue %}{% endif %}
  {%- set ns.turns = ns.turns + 1 %}
  <{{ message.role }} n={{ ns.turns }}>
  {%- if message.reasoning_content %}<think>{{ message.thinking }}</think>{% endif %}
  {%- if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}
  {%- else %}{{ message.content | tojson }}{% endif %}
  {%- for call in message.tool_calls or [] %}{{ call.function | tojson }}{% endfor %}
  {%- if ns.turns >= 9 %}{% break %}{% endif %}
{{ eos_token }}
{% endfor %}
{%- if add_generation_prompt %}<assistant>{% if not enable_thinking %}<think></think>{% endif %}{% endif %}
{{- dict(a=1) | tojson }}{{ pad_token }}"""


def test_checkpoint_template_matches_transformers(tmp_path):
    base = build_tiny_tokenizer(tmp_path / "base", "qwen")
    path = shutil.copytree(base, tmp_path / "custom")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CUSTOM_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    messages = [
        *CONVERSATIONS["tools"],
        {"role": "assistant", "content": "Done.", "reasoning": "user said thanks", "extra": None},
    ]
    template = ChatTemplate.from_tokenizer(ours)
    for tools in (None, TOOLS):
        for enable_thinking in (False, True):
            for add in (False, True):
                expected = theirs.apply_chat_template(
                    messages,
                    tools=tools,
                    add_generation_prompt=add,
                    tokenize=False,
                    enable_thinking=enable_thinking,
                )
                rendered = template.render(
                    messages,
                    tools=tools,
                    add_generation_prompt=add,
                    variables={"enable_thinking": enable_thinking},
                )
                assert rendered == expected
    assert "<think>user said thanks</think>" in rendered and "[year:4]" in rendered
    # Extra variables override special tokens of the same name, as kwargs do in transformers.
    overridden = template.render(messages[:2], variables={"eos_token": "<END>"})
    assert overridden == theirs.apply_chat_template(messages[:2], tokenize=False, eos_token="<END>")
    assert "<END>" in overridden


def test_template_errors_match_transformers(family_pair):
    ours, theirs = family_pair
    messages = [{"role": "narrator", "content": "x"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role narrator"):
        theirs.apply_chat_template(messages, tokenize=False)
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role narrator"):
        ChatTemplate.from_tokenizer(ours).render(messages)


def test_sandbox():
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        escape.render([])
    namespace = ChatTemplate("{% set ns = namespace(_x=1) %}")
    with pytest.raises(jinja2.exceptions.SecurityError, match="underscore"):
        namespace.render([])
    mutate = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        mutate.render([{"role": "user", "content": "x"}])


def test_clear_errors():
    with pytest.raises(ValueError, match=r"not valid Jinja: .* \(line 2\)"):
        ChatTemplate("ok\n{% for %}")
    with pytest.raises(ValueError, match="chat_format must be one of"):
        ChatTemplate.builtin("mistral")
    template = ChatTemplate.builtin("qwen")
    with pytest.raises(ValueError, match=r"tools\[1\] must be \{'type': 'function'"):
        template.render([], tools=[TOOLS[0], {"name": "f"}])
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.name must be a non-empty string"):
        template.render([], tools=[{"type": "function", "function": {"name": ""}}])
    with pytest.raises(ValueError, match=r"variables may not set \['tools'\]"):
        template.render([], variables={"tools": []})
    with pytest.raises(TypeError, match=r"messages\[0\]\.content: .* got object"):
        template.render([{"role": "user", "content": object()}])
    with pytest.raises(TypeError, match=r"messages\[1\] must be a Message or a dict"):
        template.render([Message.user("x"), "hello"])
    with pytest.raises(ValueError, match="Message.role must be one of"):
        Message(role="narrator", content="x")
    with pytest.raises(ValueError, match="only valid on assistant messages, not user"):
        Message(role="user", tool_calls=(ToolCall(name="f"),))
    with pytest.raises(ValueError, match="only valid on tool messages, not user"):
        Message(role="user", content="x", tool_call_id="c1")
    with pytest.raises(ValueError, match="ToolCall.name must be a non-empty string"):
        ToolCall(name="")
