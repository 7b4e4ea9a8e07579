"""Tokenizer: parity with transformers' AutoTokenizer on the same directory, loading and saving of
Hugging Face tokenizer directories, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from nonstop.models.chat_templates import BUILTIN_TEMPLATES
from nonstop.models.tokenizer import Tokenizer
from tests.models.tokenizer_fixtures import _train, build_tiny_tokenizer

FAMILIES = ("llama3", "qwen", "gemma")
TEXTS = (
    "Hello world, the answer is 42!",
    "  leading spaces and trailing  ",
    "line one\n\nline two\n\tindented",
    "Naïve café — “quotes” 🙂 and 1234567 digits",
    "<|begin_of_text|>a<|eot_id|> <|im_start|>user\nhi<|im_end|> <start_of_turn>x<end_of_turn>",
    '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call> <bos><eos><pad>',
    "",
)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory) -> tuple[str, Path, Tokenizer, object]:
    family = request.param
    path = build_tiny_tokenizer(tmp_path_factory.mktemp(family), family)
    return family, path, Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_matches_transformers(pair, add_special_tokens):
    _, _, ours, theirs = pair
    for text in TEXTS:
        expected = theirs.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_matches_transformers(pair, skip_special_tokens):
    _, _, ours, theirs = pair
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=True) + list(ours.eos_ids)
        expected = theirs.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected, text
    # Every single id decodes alike, byte-fallback and partial UTF-8 pieces included.
    for token_id in range(ours.vocab_size):
        assert ours.decode([token_id]) == theirs.decode([token_id]), token_id


def test_vocabulary_and_special_ids_match_transformers(pair):
    family, _, ours, theirs = pair
    assert ours.vocab_size == len(theirs) == 384
    assert ours.special_tokens == theirs.special_tokens_map
    assert ours.bos_id == theirs.bos_token_id
    assert ours.pad_id == theirs.pad_token_id
    assert ours.eos_ids[0] == theirs.eos_token_id
    assert ours.special_ids == frozenset(theirs.all_special_ids) | {
        i for i, t in theirs.added_tokens_decoder.items() if t.special
    }
    for token_id in (0, 1, 100, ours.vocab_size - 1):
        token = ours.id_to_token(token_id)
        assert token == theirs.convert_ids_to_tokens(token_id)
        assert ours.token_to_id(token) == token_id
    assert ours.chat_template == theirs.chat_template == BUILTIN_TEMPLATES[family]


def test_special_ids_of_each_family(tmp_path):
    # Gemma's layout puts <pad> <eos> <bos> <unk> <start_of_turn> <end_of_turn> at ids 0..5.
    gemma = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "g", "gemma"))
    assert (gemma.pad_id, gemma.bos_id, gemma.eos_ids) == (0, 2, (1, 5))
    # Llama 3 and Qwen append their special tokens after the 376 / 373 trained ids.
    llama = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "l", "llama3"))
    assert llama.bos_id == 376 and llama.eos_ids == (380, 377, 381) and llama.pad_id == 383
    qwen = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "q", "qwen"))
    assert qwen.bos_id is None and qwen.eos_ids == (379, 377) and qwen.pad_id == 377
    assert qwen.token_to_id("<tool_call>") not in qwen.special_ids  # added, not special
    assert qwen.decode([qwen.token_to_id("<tool_call>")], skip_special_tokens=True) == "<tool_call>"


def test_fixture_is_deterministic_and_sized(tmp_path):
    for family in FAMILIES:
        # Train twice without the in-process cache: BPE training must not depend on hash order.
        assert _train(family, 401).to_str() == _train(family, 401).to_str()
        a = build_tiny_tokenizer(tmp_path / f"{family}-a", family, vocab_size=401)
        b = build_tiny_tokenizer(tmp_path / f"{family}-b", family, vocab_size=401)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (a / name).read_bytes() == (b / name).read_bytes()
        assert Tokenizer.from_pretrained(a).vocab_size == 401
    with pytest.raises(ValueError, match="vocab_size for gemma must be in"):
        build_tiny_tokenizer(tmp_path / "small", "gemma", vocab_size=300)


def test_save_pretrained_round_trips_through_transformers(pair, tmp_path):
    _, _, ours, _ = pair
    saved = ours.save_pretrained(tmp_path / "saved")
    theirs = AutoTokenizer.from_pretrained(saved)
    again = Tokenizer.from_pretrained(saved)
    for text in TEXTS:
        for add in (False, True):
            assert again.encode(text, add_special_tokens=add) == theirs.encode(
                text, add_special_tokens=add
            )
            assert again.encode(text, add_special_tokens=add) == ours.encode(
                text, add_special_tokens=add
            )
    assert again.chat_template == theirs.chat_template == ours.chat_template
    assert again.special_tokens == ours.special_tokens
    # eos_ids beyond eos_token live in generation_config.json, which save_pretrained does not write.
    assert again.eos_ids == ours.eos_ids[:1]


def test_reads_what_transformers_writes(pair, tmp_path):
    """transformers 5 moves the template into chat_template.jinja; we must read it from there."""
    _, path, ours, theirs = pair
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    theirs = AutoTokenizer.from_pretrained(path)
    theirs.chat_template = template
    theirs.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "chat_template.jinja").is_file()
    loaded = Tokenizer.from_pretrained(tmp_path / "hf")
    assert loaded.chat_template == template
    assert loaded.special_tokens == ours.special_tokens
    assert loaded.encode(TEXTS[4]) == ours.encode(TEXTS[4])
    # And saving over that directory keeps the jinja file from shadowing a new template.
    loaded.with_chat_template("{{ messages | length }}").save_pretrained(tmp_path / "hf")
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == "{{ messages | length }}"


def _edit_config(path: Path, destination: Path, **changes) -> Path:
    shutil.copytree(path, destination)
    config_file = destination / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_file.write_text(json.dumps(config))
    return destination


def test_named_templates_and_added_token_dicts(tmp_path):
    path = build_tiny_tokenizer(tmp_path / "base", "qwen")
    templates = [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "tools"},
    ]
    eos = {
        "__type": "AddedToken",
        "content": "<|im_end|>",
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
        "special": True,
    }
    edited = _edit_config(path, tmp_path / "edited", chat_template=templates, eos_token=eos)
    ours, theirs = Tokenizer.from_pretrained(edited), AutoTokenizer.from_pretrained(edited)
    assert ours.chat_templates == theirs.chat_template == {"default": "plain", "tool_use": "tools"}
    for tools in (None, [{"type": "function", "function": {"name": "f"}}]):
        assert ours.get_chat_template(tools=tools is not None) == theirs.get_chat_template(
            tools=tools
        )
    assert ours.eos_ids[0] == theirs.eos_token_id == ours.token_to_id("<|im_end|>")
    with pytest.raises(ValueError, match="no chat template named 'other'"):
        ours.get_chat_template("other")


def test_post_processor_decides_bos_not_add_bos_token(tmp_path):
    """transformers 5 ignores add_bos_token when tokenizer.json exists; so must we."""
    path = build_tiny_tokenizer(tmp_path / "base", "llama3")
    for add_bos in (False, True):
        edited = _edit_config(path, tmp_path / f"bos-{add_bos}", add_bos_token=add_bos)
        ours, theirs = Tokenizer.from_pretrained(edited), AutoTokenizer.from_pretrained(edited)
        ids = ours.encode("Hello", add_special_tokens=True)
        assert ids == theirs.encode("Hello", add_special_tokens=True)
        assert ids[0] == ours.bos_id and ids[1:] == ours.encode("Hello")


def test_eos_ids_from_generation_and_model_config(tmp_path):
    path = build_tiny_tokenizer(tmp_path / "base", "gemma")
    (path / "config.json").write_text(json.dumps({"eos_token_id": [3, 1]}))
    assert Tokenizer.from_pretrained(path).eos_ids == (1, 5, 3)
    (path / "config.json").write_text(json.dumps({"eos_token_id": 9999}))
    with pytest.raises(ValueError, match=r"eos_token_id 9999 is outside the vocabulary \[0, 384\)"):
        Tokenizer.from_pretrained(path)


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/tokenizer\.json not found"):
        Tokenizer.from_pretrained(tmp_path / "empty")
    path = build_tiny_tokenizer(tmp_path / "base", "llama3")
    unknown = _edit_config(path, tmp_path / "unknown", eos_token="<|not_a_token|>")
    with pytest.raises(
        ValueError,
        match=r"tokenizer_config\.json: eos_token '<\|not_a_token\|>' is "
        r"not a token of the vocabulary",
    ):
        Tokenizer.from_pretrained(unknown)
    bad_type = _edit_config(path, tmp_path / "bad_type", bos_token=7)
    with pytest.raises(ValueError, match="bos_token must be a string or an AddedToken dict"):
        Tokenizer.from_pretrained(bad_type)
    bad_template = _edit_config(path, tmp_path / "bad_template", chat_template={"x": 1})
    with pytest.raises(ValueError, match="chat_template must be a string or a list"):
        Tokenizer.from_pretrained(bad_template)
    config = json.loads((path / "tokenizer_config.json").read_text())
    decoder = config["added_tokens_decoder"]
    decoder["5"] = decoder.pop("380")  # <|eot_id|> claimed at the wrong id
    moved = _edit_config(path, tmp_path / "moved", added_tokens_decoder=decoder)
    with pytest.raises(ValueError, match=r"names '<\|eot_id\|>' as id 5, but .* gives it id 380"):
        Tokenizer.from_pretrained(moved)
    tokenizer = Tokenizer.from_pretrained(path)
    with pytest.raises(KeyError, match="not a token"):
        tokenizer.token_to_id("<|nope|>")
    with pytest.raises(KeyError, match=r"outside the vocabulary \[0, 384\)"):
        tokenizer.id_to_token(384)
    with pytest.raises(ValueError, match="no chat template named 'default'; it has none"):
        tokenizer.with_chat_template({}).get_chat_template()
