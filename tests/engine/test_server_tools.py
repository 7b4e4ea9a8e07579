"""Tool calling through `nonstop serve` and the official openai client, for every parser's family.

Each family gets a tiny checkpoint built to say one thing: its tokenizer (the tiny Llama 3 one)
has the pieces of that family's tool-call turn as added tokens, and its weights are a bigram
table (attention and MLP outputs zeroed, so the last token alone picks the next): after the
generation prompt it writes the prose, the call's opening and the call's rest, then <|eot_id|>.
After a forced opening (tool_choice "required" or a named function) it writes the rest. One server
per family (`--tool-parser`), started together.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import tokenizers
from safetensors.numpy import save_file

from nonstop.models import ModelConfig
from nonstop.models.chat import ChatTemplate
from nonstop.models.hf_weights import weight_specs
from nonstop.models.tokenizer import Tokenizer
from nonstop.models.tool_parsers import TOOL_PARSERS, get_parser
from tests.engine.test_server import API_KEY, VOCAB, spawn_server, wait_healthy
from tests.models.tokenizer_fixtures import build_tiny_tokenizer

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGUMENTS = {"city": "Paris", "note": "a </tool_call> b"}  # the closing tag inside a string
CONTENT = "Let me check."
CALLS = {
    "hermes": f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(ARGUMENTS)}}}'
              "\n</tool_call>",
    "llama3_json": f'{{"name": "get_weather", "parameters": {json.dumps(ARGUMENTS)}}}',
    "llama4_pythonic": f'[get_weather(city="Paris", note={json.dumps(ARGUMENTS["note"])})]',
    "mistral": f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {json.dumps(ARGUMENTS)}}}]',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather"
                   f"\n```json\n{json.dumps(ARGUMENTS)}\n```<｜tool▁call▁end｜>"
                   "<｜tool▁calls▁end｜>",
    "gemma": f'```tool_call\n{{"name": "get_weather", "arguments": {json.dumps(ARGUMENTS)}}}\n```',
}
# The prose before the call ("" where the format has none), as the model writes it.
PROSE = {"hermes": CONTENT + "\n", "llama3_json": CONTENT + "\n", "llama4_pythonic": "",
         "mistral": CONTENT, "deepseek_v3": CONTENT, "gemma": CONTENT + "\n"}
# Compact: the tiny tokenizer spends about 300 tokens on the template's tool instructions.
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "parameters": {"type": "object"}}}]
MAX_LEN = 384
MODEL_VOCAB = 300  # every family's model alike, so the first server's compiles serve the rest


def _generation_prompt_tokens(tokenizer: Tokenizer, forced: str = "") -> list[int]:
    template = ChatTemplate.from_tokenizer(tokenizer, tools=True)
    text = template.render(MESSAGES, tools=TOOLS, add_generation_prompt=True)
    return tokenizer.encode(text + forced, add_special_tokens=False)


def build_tool_checkpoint(directory: Path, parser: str) -> Path:
    """The tiny Llama 3 tokenizer with `parser`'s turn pieces as added tokens, and bigram weights
    that write them (see the module docstring)."""
    build_tiny_tokenizer(directory, "llama3", vocab_size=VOCAB)
    call, p = CALLS[parser], get_parser(parser)
    opening = p.call_prefix(None)
    named = p.call_prefix("get_weather")
    assert call.startswith(named) and named.startswith(opening)
    # The named opening is a token of its own too, so the forced prompt ends in a token that
    # nothing else is followed by.
    pieces = [x for x in (PROSE[parser], opening, named, call[len(opening):], call[len(named):])
              if x]
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.add_tokens([tokenizers.AddedToken(x, normalized=False, special=False)
                        for x in pieces])
    backend.save(str(directory / "tokenizer.json"))
    tokenizer = Tokenizer.from_pretrained(directory)
    ids = {x: tokenizer.encode(x, add_special_tokens=False) for x in pieces}
    assert all(len(v) == 1 for v in ids.values()), ids
    piece = {x: v[0] for x, v in ids.items()}
    eot = tokenizer.encode("<|eot_id|>", add_special_tokens=False)[0]
    chain = [*([piece[PROSE[parser]]] if PROSE[parser] else []), piece[opening],
             piece[call[len(opening):]], eot]
    edges = [(_generation_prompt_tokens(tokenizer)[-1], chain[0]),
             *zip(chain[:-1], chain[1:], strict=True),
             (piece[named], piece[call[len(named):]]), (piece[call[len(named):]], eot)]
    assert len(dict(edges)) == len(set(edges)), f"a token would need two successors: {edges}"
    assert _generation_prompt_tokens(tokenizer, opening)[-1] == piece[opening]
    assert _generation_prompt_tokens(tokenizer, named)[-1] == piece[named]
    vocab = MODEL_VOCAB
    assert tokenizer.vocab_size <= vocab
    cfg = ModelConfig.tiny("llama", vocab_size=vocab, bos_token_id=tokenizer.bos_id,
                           eos_token_ids=tokenizer.eos_ids, pad_token_id=tokenizer.pad_id,
                           tie_embeddings=False, num_layers=1)
    rng = np.random.default_rng(0)
    tensors = {}
    for spec in weight_specs(cfg):
        name = spec.hf_name
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = np.zeros(spec.hf_shape, np.float32)  # the layers add nothing
        elif len(spec.hf_shape) == 1:
            tensors[name] = np.ones(spec.hf_shape, np.float32)
        else:
            tensors[name] = (rng.standard_normal(spec.hf_shape) * 0.02).astype(np.float32)
    embed = rng.standard_normal((vocab, cfg.hidden_size)).astype(np.float32)
    tensors["model.embed_tokens.weight"] = embed
    head = tensors["lm_head.weight"]
    for src, dst in set(edges):  # after `src`, `dst` by a wide margin
        head[dst] += 40.0 * embed[src] / np.linalg.norm(embed[src])
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({**cfg.to_hf(), "dtype": "float32"}))
    return directory


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, openai.OpenAI]]:
    """One server per parser; the first compiles into the suite's persistent compilation cache
    (tests/conftest.py), the others start together from it. The openai client of each."""
    with contextlib.ExitStack() as stack:
        started = {}
        for i, parser in enumerate(TOOL_PARSERS):
            directory = build_tool_checkpoint(tmp_path_factory.mktemp(parser), parser)
            log = tmp_path_factory.mktemp("log") / f"{parser}.log"
            process, url = stack.enter_context(spawn_server(
                directory, log, extra=["--tool-parser", parser, "--max-len",
                                                  str(MAX_LEN), "--max-slots", "1"]))
            started[parser] = (process, url, log)
            if i == 0:
                wait_healthy(process, url, log)
        for process, url, log in started.values():
            wait_healthy(process, url, log)
        yield {parser: openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0,
                                     timeout=120)
               for parser, (_, url, _) in started.items()}


def _create(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=MESSAGES, temperature=0, max_tokens=8,
                                          **kwargs)


def _call_of(tool_call) -> tuple[str, dict]:
    return tool_call.function.name, json.loads(tool_call.function.arguments)


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_tool_calls_come_back_as_tool_calls(clients, parser):
    out = _create(clients[parser], tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert _call_of(call) == ("get_weather", ARGUMENTS)
    assert call.type == "function" and call.id
    assert choice.message.content == (PROSE[parser].strip() or None)


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_streamed_tool_calls_come_back_as_delta_tool_calls(clients, parser):
    content, calls, finish = [], {}, None
    for chunk in _create(clients[parser], tools=TOOLS, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": delta.id, "name": "",
                                                       "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert "".join(content) == PROSE[parser]  # the call's text never leaks into content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", ARGUMENTS)]
    assert all(c["id"] for c in calls.values())


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_tool_choice_variants(clients, parser):
    client = clients[parser]
    plain = _create(client, tools=TOOLS, tool_choice="none").choices[0]
    assert plain.finish_reason == "stop" and not plain.message.tool_calls
    assert plain.message.content == (PROSE[parser] + CALLS[parser]).strip()
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for stream in (False, True):
            if stream:
                chunks = list(_create(client, tools=TOOLS, tool_choice=choice, stream=True))
                deltas = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or []]
                assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
                    ("get_weather", ARGUMENTS)]
                assert not any(ch.delta.content for c in chunks for ch in c.choices)
            else:
                out = _create(client, tools=TOOLS, tool_choice=choice).choices[0]
                assert out.finish_reason == "tool_calls" and out.message.content is None
                assert [_call_of(c) for c in out.message.tool_calls] == [
                    ("get_weather", ARGUMENTS)]
    with pytest.raises(openai.BadRequestError) as info:
        _create(client, tools=TOOLS, tool_choice={"type": "function",
                                                  "function": {"name": "get_time"}})
    assert info.value.param == "tool_choice"
