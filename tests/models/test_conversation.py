"""Conversation: appending is prefix-stable, model tokens are kept verbatim and masked, and the
tokens equal the tokenized template render where piece-wise tokenization allows it."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models
from transformers import AutoTokenizer

from nonstop.models.chat import ChatTemplate, Message, ToolCall
from nonstop.models.conversation import Conversation
from nonstop.models.tokenizer import Tokenizer
from tests.models.test_chat import TOOLS
from tests.models.tokenizer_fixtures import build_tiny_tokenizer

FAMILIES = ("llama3", "qwen", "gemma")
END_OF_TURN = {"llama3": "<|eot_id|>", "qwen": "<|im_end|>", "gemma": "<end_of_turn>"}

EPISODE = [
    Message.system("Use tools when useful."),
    Message.user("Weather in Zürich and the time?"),
    Message.assistant(
        tool_calls=[
            ToolCall(name="get_weather", arguments={"city": "Zürich"}, id="c1"),
            ToolCall(name="now", arguments={}, id="c2"),
        ]
    ),
    Message.tool('{"temp": 21}', tool_call_id="c1", name="get_weather"),
    Message.tool("12:00", tool_call_id="c2", name="now"),
    Message.assistant("It is 21°C at 12:00."),
    Message.user("Thanks!\n\nBye."),
    Message.assistant("  Bye — see you."),
]
# Append boundaries: each step is one append_messages call (tool results of a turn together).
STEPS = [(0, 1), (1, 2), (2, 3), (3, 5), (5, 6), (6, 7), (7, 8)]


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    family = request.param
    path = build_tiny_tokenizer(tmp_path_factory.mktemp(family), family)
    tokenizer = Tokenizer.from_pretrained(path)
    return family, tokenizer, ChatTemplate.from_tokenizer(tokenizer), path


def _text_of(tokenizer: Tokenizer, ids: list[int], mask: list[bool], want: bool) -> list[str]:
    """The runs of tokens whose mask equals `want`, decoded."""
    runs, current = [], []
    for token_id, flag in zip(ids, mask, strict=True):
        if flag == want:
            current.append(token_id)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_text_conversation_equals_tokenized_render(setup):
    family, tokenizer, template, path = setup
    conversation = Conversation.from_messages(tokenizer, template, EPISODE, tools=TOOLS)
    expected = tokenizer.encode(template.render(EPISODE, tools=TOOLS))
    assert conversation.tokens == expected
    # ...which is what transformers' apply_chat_template(tokenize=True) gives as well.
    theirs = AutoTokenizer.from_pretrained(path)
    dicts = [m.to_dict() for m in EPISODE]
    assert expected == theirs.apply_chat_template(dicts, tools=TOOLS, return_dict=False)
    # Loss only on assistant text, each run ending with the end-of-turn token.
    eot = END_OF_TURN[family]
    assert _text_of(tokenizer, conversation.tokens, conversation.loss_mask, True) == [
        '{"name": "get_weather", "parameters": {"city": "Zürich"}}\n'
        '{"name": "now", "parameters": {}}' + eot
        if family == "llama3"
        else '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>' + eot
        if family == "qwen"
        else '```tool_call\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n```\n'
        '```tool_call\n{"name": "now", "arguments": {}}\n```' + eot,
        "It is 21°C at 12:00." + eot,
        "  Bye — see you." + eot,
    ]


def test_incremental_building_is_prefix_stable(setup):
    _, tokenizer, template, _ = setup
    whole = Conversation.from_messages(tokenizer, template, EPISODE, tools=TOOLS)
    conversation = Conversation(tokenizer, template, tools=TOOLS)
    for start, stop in STEPS:
        before = conversation.tokens
        added = conversation.append_messages(EPISODE[start:stop])
        assert conversation.tokens == before + added and len(added) > 0
        assert len(conversation.roles) == len(conversation.loss_mask) == len(conversation)
    assert conversation.tokens == whole.tokens
    assert conversation.loss_mask == whole.loss_mask
    assert conversation.roles == whole.roles


def test_generation_prompt_matches_transformers(setup):
    _, tokenizer, template, path = setup
    theirs = AutoTokenizer.from_pretrained(path)
    conversation = Conversation(tokenizer, template, tools=TOOLS)
    for start, stop in STEPS[:2]:
        conversation.append_messages(EPISODE[start:stop])
    before = conversation.tokens
    prompt = conversation.generation_prompt_tokens()
    dicts = [m.to_dict() for m in EPISODE[:2]]
    assert prompt == theirs.apply_chat_template(
        dicts, tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    assert prompt[: len(before)] == before and conversation.tokens == before  # nothing appended


def test_model_tokens_are_kept_verbatim_and_closed(setup):
    family, tokenizer, template, _ = setup
    eot = tokenizer.token_to_id(END_OF_TURN[family])
    conversation = Conversation(tokenizer, template)
    conversation.append_messages(EPISODE[1:2])
    history = conversation.tokens
    prompt = conversation.generation_prompt_tokens()
    # A sampled turn that tokenizes differently from its text: "the" spelled a letter at a time.
    sampled = [tokenizer.token_to_id(t) for t in _letter_tokens(tokenizer, "the")] + [eot]
    assert sampled[:-1] != tokenizer.encode("the")
    added = conversation.append_model_tokens(sampled)
    tokens = conversation.tokens
    assert tokens[: len(prompt)] == prompt
    assert tokens[len(prompt) : len(prompt) + len(sampled)] == sampled
    assert conversation.loss_mask == [False] * len(prompt) + [True] * len(sampled) + [False] * (
        len(tokens) - len(prompt) - len(sampled)
    )
    # The closing text after the model's end-of-turn token, by hand: "\n" for ChatML and Gemma.
    closing = tokens[len(prompt) + len(sampled) :]
    assert tokenizer.decode(closing) == {"llama3": "", "qwen": "\n", "gemma": "\n"}[family]
    assert added == tokens[len(history) :] == prompt[len(history) :] + sampled + closing
    assert set(conversation.roles[len(history) :]) == {"assistant"}
    assert conversation.messages[-1] == {"role": "assistant", "content": "the"}
    # The next turn renders after it, prefix-stably, as if the assistant had written "the".
    before = conversation.tokens
    conversation.append_messages([Message.user("Again?")])
    assert conversation.tokens[: len(before)] == before
    text_version = [*EPISODE[1:2], Message.assistant("the"), Message.user("Again?")]
    reference = tokenizer.encode(template.render(text_version))
    assert len(conversation) == len(reference) + len(sampled) - 1 - len(tokenizer.encode("the"))
    assert tokenizer.decode(conversation.tokens) == tokenizer.decode(reference)


def test_truncated_model_turn_gets_the_end_of_turn_token(setup):
    family, tokenizer, template, _ = setup
    eot = tokenizer.token_to_id(END_OF_TURN[family])
    conversation = Conversation(tokenizer, template)
    conversation.append_messages(EPISODE[1:2])
    prompt_length = len(conversation.generation_prompt_tokens())
    sampled = tokenizer.encode("It is")  # cut off by max_tokens: no end-of-turn token
    conversation.append_model_tokens(sampled)
    closing = conversation.tokens[prompt_length + len(sampled) :]
    assert closing[0] == eot
    assert tokenizer.decode(closing) == END_OF_TURN[family] + ("" if family == "llama3" else "\n")
    assert conversation.loss_mask[prompt_length:] == [True] * len(sampled) + [False] * len(closing)


def test_other_stop_token_closes_the_turn(tmp_path):
    """A Qwen model that stops on <|endoftext|> (a generation_config eos id) keeps that token and
    only gets the newline after it."""
    tokenizer = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, "qwen"))
    endoftext = tokenizer.token_to_id("<|endoftext|>")
    assert endoftext in tokenizer.eos_ids
    conversation = Conversation(tokenizer, "qwen")
    conversation.append_messages([Message.user("Hi")])
    sampled = [*tokenizer.encode("Yo"), endoftext]
    added = conversation.append_model_tokens(sampled)
    assert tokenizer.decode(added) == "<|im_start|>assistant\nYo<|endoftext|>\n"


def test_roles_per_token(tmp_path):
    tokenizer = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, "llama3"))
    conversation = Conversation(tokenizer, "llama3")
    conversation.append_messages([Message.system("S"), Message.user("U")])
    conversation.append_model_tokens(tokenizer.encode("A"))
    conversation.append_messages([Message.tool("T")])
    by_role: dict[str, list[int]] = {}
    for token_id, role in zip(conversation.tokens, conversation.roles, strict=True):
        by_role.setdefault(role, []).append(token_id)
    assert {role: tokenizer.decode(ids) for role, ids in by_role.items()} == {
        "system": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>",
        "user": "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>",
        "assistant": "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>",
        "tool": "<|start_header_id|>ipython<|end_header_id|>\n\nT<|eot_id|>",
    }


def test_grouped_tool_results_must_be_appended_together(tmp_path):
    tokenizer = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, "qwen"))
    conversation = Conversation(tokenizer, "qwen", tools=TOOLS)
    conversation.append_messages(EPISODE[:3])
    conversation.append_messages([EPISODE[3]])
    before = (conversation.tokens, conversation.loss_mask, conversation.messages)
    with pytest.raises(ValueError, match="not prefix-stable here: rendering \\['tool'\\] messages"):
        conversation.append_messages([EPISODE[4], EPISODE[5]])
    # A failed append changes nothing.
    assert (conversation.tokens, conversation.loss_mask, conversation.messages) == before
    together = Conversation(tokenizer, "qwen", tools=TOOLS)
    together.append_messages(EPISODE[:3])
    together.append_messages(EPISODE[3:5])
    assert together.tokens[-3:] == tokenizer.encode("</tool_response><|im_end|>\n")


def test_template_that_rewrites_history_is_refused(tmp_path):
    tokenizer = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, "qwen"))
    counting = ChatTemplate(
        "{{ messages | length }}{% for m in messages %}|{{ m.content }}{% endfor %}"
    )
    conversation = Conversation(tokenizer, counting)
    conversation.append_messages([Message.user("a")])
    with pytest.raises(ValueError, match="changes the text already tokenized at character 0"):
        conversation.append_messages([Message.user("b")])


def test_bad_inputs(tmp_path):
    tokenizer = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, "gemma"))
    with pytest.raises(ValueError, match="template must be a ChatTemplate, None or one of"):
        Conversation(tokenizer, "mistral")
    conversation = Conversation(tokenizer, "gemma")
    with pytest.raises(ValueError, match=r"model token ids must lie in \[0, 384\)"):
        conversation.append_model_tokens([5, 384])
    # A template whose assistant turn cannot be told apart from its generation prompt.
    odd = ChatTemplate(
        "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
        "{% if add_generation_prompt %}assistant says:{% endif %}"
    )
    conversation = Conversation(tokenizer, odd)
    conversation.append_messages([Message.user("q")])
    with pytest.raises(ValueError, match="does not begin with its generation prompt"):
        conversation.append_model_tokens([10])


def test_where_piecewise_tokenization_differs():
    """A tokenizer that merges across the header/content boundary: BPE over the whole render joins
    the header's "\\n" with the content's leading "\\n"; the Conversation keeps them apart, as the
    model would see them when it generates the content after the header. Same text, other ids."""
    vocab = {"<t>": 0, "</t>": 1, "a": 2, "b": 3, "\n": 4, "\n\n": 5, "x": 6}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("\n", "\n")]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken("<t>", special=True), AddedToken("</t>", special=True)])
    tokenizer = Tokenizer(backend, special_tokens={"eos_token": "</t>"})
    template = ChatTemplate(
        "{% for m in messages %}<t>{{ 'a' if m.role == 'user' else 'b' }}\n{{ m.content }}</t>"
        "{% endfor %}{% if add_generation_prompt %}<t>b\n{% endif %}"
    )
    messages = [Message.user("x"), Message.assistant("\nx")]
    conversation = Conversation.from_messages(tokenizer, template, messages)
    full = tokenizer.encode(template.render(messages))
    assert full == [0, 2, 4, 6, 1, 0, 3, 5, 6, 1]  # "<t>a\nx</t><t>b\n\nx</t>"
    assert conversation.tokens == [0, 2, 4, 6, 1, 0, 3, 4, 4, 6, 1]
    assert tokenizer.decode(conversation.tokens) == tokenizer.decode(full)
    assert conversation.loss_mask == [False] * 8 + [True] * 3


def _letter_tokens(tokenizer: Tokenizer, text: str) -> list[str]:
    """`text` as single-character tokens of the vocabulary (each family has every letter)."""
    return [tokenizer.id_to_token(tokenizer.encode(ch)[-1]) for ch in text]
