"""A character-level tokenizer built in memory, for tiny models trained from scratch.

`char_tokenizer("qwen")` returns a `nonstop.models.Tokenizer` whose vocabulary is the special
tokens of a built-in chat format (ids 0, 1, ...) followed by one token per printable ASCII
character, newline and tab. It is a `tokenizers` WordLevel model over a pre-tokenizer that
isolates every character, so `decode(encode(text)) == text` for any ASCII text, and special
tokens such as `<|im_start|>` are single ids. It carries nonstop's built-in chat template for
the format (`nonstop.models.chat_templates`), so `Conversation` and chat data work unchanged, and
`save_pretrained` writes a directory that transformers' AutoTokenizer loads too. Nothing is
downloaded or trained: the same call always gives the same ids.

Characters outside the vocabulary become the unknown token `<unk>`.
"""

from __future__ import annotations

import string

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from nonstop.models.chat_templates import BUILTIN_TEMPLATES, CHAT_FORMATS, ChatFormat
from nonstop.models.tokenizer import Tokenizer

UNK_TOKEN = "<unk>"
# Every character a char tokenizer knows, in id order after the special tokens.
CHARACTERS: tuple[str, ...] = tuple(
    dict.fromkeys(string.digits + string.ascii_letters + string.punctuation + " \n\t")
)

# Special tokens of each chat format in id order, the named ones, and the stop tokens — the
# structure of the real checkpoints' tokenizers, not their ids.
_SPECIAL: dict[ChatFormat, tuple[str, ...]] = {
    "llama3": (
        "<|finetune_right_pad_id|>",
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
    ),
    "qwen": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    "gemma": ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
}
_NAMED: dict[ChatFormat, dict[str, str]] = {
    "llama3": {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|finetune_right_pad_id|>",
    },
    "qwen": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "gemma": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
}
_EXTRA_STOPS: dict[ChatFormat, tuple[str, ...]] = {
    "llama3": ("<|end_of_text|>", "<|eom_id|>"),
    "qwen": ("<|endoftext|>",),
    "gemma": ("<end_of_turn>",),
}


def char_tokenizer(chat_format: ChatFormat = "qwen") -> Tokenizer:
    """The character-level tokenizer with `chat_format`'s special tokens and chat template."""
    if chat_format not in CHAT_FORMATS:
        raise ValueError(
            f"char_tokenizer: chat_format={chat_format!r} is invalid; valid: {CHAT_FORMATS}"
        )
    specials = _SPECIAL[chat_format]
    vocab = {token: index for index, token in enumerate((*specials, UNK_TOKEN, *CHARACTERS))}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (*specials, UNK_TOKEN)]
    )
    named = dict(_NAMED[chat_format], unk_token=UNK_TOKEN)
    extra_stops = [vocab[token] for token in _EXTRA_STOPS[chat_format]]
    return Tokenizer(
        backend,
        special_tokens=named,
        extra_special_tokens=[t for t in specials if t not in named.values()],
        chat_templates={"default": BUILTIN_TEMPLATES[chat_format]},
        extra_eos_ids=extra_stops,
        source=f"char_tokenizer({chat_format!r})",
    )
