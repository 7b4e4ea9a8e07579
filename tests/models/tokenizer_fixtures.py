"""Tiny, deterministic Llama 3 / Qwen / Gemma-style tokenizers for tests, trained locally.

`build_tiny_tokenizer(directory, family)` trains a small BPE on a built-in corpus with `tokenizers`,
adds the family's special tokens, sets nonstop's built-in chat template for the family and saves a
transformers `PreTrainedTokenizerFast` directory that both `nonstop.models.tokenizer.Tokenizer` and
transformers' `AutoTokenizer` load. The token ids differ from the real checkpoints'; the structure
follows them:
- llama3: byte-level BPE with Llama 3's split regex, BOS added by the post-processor,
  eos_token <|eot_id|> plus <|end_of_text|> / <|eom_id|> as further stop ids.
- qwen: byte-level BPE with Qwen2's split regex (single digits), NFC, no BOS, eos_token <|im_end|>,
  <tool_call>-style tags as added (non-special) tokens, generation_config eos [<|im_end|>,
  <|endoftext|>].
- gemma: SentencePiece-style BPE (spaces as "▁", no pre-tokenizer, byte fallback), BOS added by the
  post-processor, eos_token <eos> plus <end_of_turn> as a further stop id.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Literal

import tokenizers
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from nonstop.models.chat_templates import BUILTIN_TEMPLATES
from nonstop.models.tokenizer import Tokenizer

Family = Literal["llama3", "qwen", "gemma"]

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Special tokens in id order (appended after the trained vocabulary, as in the real checkpoints,
# except Gemma, whose first ids are <pad> <eos> <bos> <unk>).
_SPECIAL: dict[Family, tuple[str, ...]] = {
    "llama3": (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
        "<|finetune_right_pad_id|>",
    ),
    "qwen": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    "gemma": ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
}
# Added but not special (kept by decode(skip_special_tokens=True)), as in Qwen2.5.
_QWEN_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

_NAMED: dict[Family, dict[str, str]] = {
    "llama3": {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|finetune_right_pad_id|>",
    },
    "qwen": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "gemma": {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    },
}
_STOP_TOKENS: dict[Family, tuple[str, ...]] = {
    "llama3": ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"),
    "qwen": ("<|im_end|>", "<|endoftext|>"),
    "gemma": ("<eos>", "<end_of_turn>"),
}

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
You are a helpful assistant. Answer the question, then stop. What is the weather in Paris today?
The user asked for the sum of two numbers: 12 + 30 = 42, and 7 * 6 = 42 as well.
Call the function with the arguments it needs. The tool returned an error; try again later.
def add(a: int, b: int) -> int:
    return a + b
{"name": "add", "arguments": {"a": 2, "b": 3}}
{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}
{"type": "function", "function": {"name": "search", "description": "Search the web.",
 "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
system
user
assistant
model
tool
The answer is 5. Thank you! Here is the result of the search: three documents were found.
Think step by step: first read the problem, then write the plan, and finally check the answer.
Naïve café résumé — “quotes” and emoji 🙂 appear in real text, and so do tabs\tand newlines.
In 1969, people walked on the moon; in 2024, models learned to call tools and reason in turns.
"""


_PARAGRAPHS = """\
Paris is the capital of France.

It is known for the Eiffel Tower.

The weather today is sunny, with a high of 21 degrees.


A second answer follows after two blank lines.
"""


def _corpus() -> list[str]:
    # Each line, the whole text, and paragraphs (blank lines get merges, as in real vocabularies).
    lines = _CORPUS.splitlines(keepends=True)
    return lines * 4 + ["".join(lines)] * 2 + [_PARAGRAPHS] * 6


def _train(family: Family, vocab_size: int) -> tokenizers.Tokenizer:
    n_special = len(_SPECIAL[family]) + (len(_QWEN_TAGS) if family == "qwen" else 0)
    if family == "gemma":
        byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
        tokenizer = tokenizers.Tokenizer(
            models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True)
        )
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        # Specials and byte-fallback pieces first, so they take the lowest ids.
        head = [*_SPECIAL[family], *byte_tokens]
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=head, limit_alphabet=96, show_progress=False
        )
        tokenizer.train_from_iterator(_corpus(), trainer)
        # The byte pieces were trained as special tokens; make them plain vocabulary again.
        state = json.loads(tokenizer.to_str())
        state["added_tokens"] = [
            t for t in state["added_tokens"] if t["content"] in _SPECIAL[family]
        ]
        tokenizer = tokenizers.Tokenizer.from_str(json.dumps(state))
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)]
        )
    else:
        split = _LLAMA3_SPLIT if family == "llama3" else _QWEN_SPLIT
        tokenizer = tokenizers.Tokenizer(models.BPE())
        if family == "qwen":
            tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - n_special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(_corpus(), trainer)
        tokenizer.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in _SPECIAL[family]]
        )
        if family == "qwen":
            tokenizer.add_tokens(
                [AddedToken(t, special=False, normalized=False) for t in _QWEN_TAGS]
            )
            tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        else:
            bos_id = tokenizer.token_to_id("<|begin_of_text|>")
            tokenizer.post_processor = processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", bos_id)],
            )
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(
            f"the built-in corpus yields a {family} vocabulary of "
            f"{tokenizer.get_vocab_size(with_added_tokens=True)}, not vocab_size={vocab_size}; "
            f"choose a vocab_size between {_MIN_VOCAB[family]} and 512"
        )
    return tokenizer


_MIN_VOCAB: dict[Family, int] = {"llama3": 264, "qwen": 263, "gemma": 337}


@functools.lru_cache(maxsize=16)
def _trained_json(family: Family, vocab_size: int) -> str:
    return _train(family, vocab_size).to_str()


def build_tiny_tokenizer(directory: str | Path, family: Family, vocab_size: int = 384) -> Path:
    """Write a tiny `family` tokenizer with `vocab_size` ids (added tokens included) to
    `directory` and return it. Deterministic: the same arguments give the same files."""
    if family not in _SPECIAL:
        raise ValueError(f"family must be one of {tuple(_SPECIAL)}, got {family!r}")
    if not _MIN_VOCAB[family] <= vocab_size <= 512:
        raise ValueError(
            f"vocab_size for {family} must be in [{_MIN_VOCAB[family]}, 512], got {vocab_size}"
        )
    backend = tokenizers.Tokenizer.from_str(_trained_json(family, vocab_size))
    stop_ids = [backend.token_to_id(t) for t in _STOP_TOKENS[family]]
    tokenizer = Tokenizer(
        backend,
        special_tokens=_NAMED[family],
        chat_templates={"default": BUILTIN_TEMPLATES[family]},
        extra_eos_ids=stop_ids,
        config={"model_max_length": 4096},
    )
    path = tokenizer.save_pretrained(directory)
    # The further stop ids live where checkpoints keep them.
    generation_config = {"eos_token_id": stop_ids}
    if (bos := _NAMED[family].get("bos_token")) is not None:
        generation_config["bos_token_id"] = backend.token_to_id(bos)
    (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return path
