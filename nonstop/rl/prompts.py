"""Prompts in and answers out for single-turn RL: the ids an engine is given for a task's prompt,
and the text a reward sees of the ids it sampled."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from nonstop.models import Conversation, Message, Tokenizer

PromptFormat = Literal["raw", "chat"]


def encode_prompt(tokenizer: Tokenizer, prompt: str, fmt: PromptFormat, add_bos: bool) -> list[int]:
    """The token ids the engine is given for a prompt ("chat": a user turn and the generation
    header of the tokenizer's chat template)."""
    if fmt == "chat":
        conversation = Conversation(tokenizer)
        conversation.append_messages([Message.user(prompt)])
        return list(conversation.generation_prompt_tokens())
    ids = tokenizer.encode(prompt)
    return ([tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []) + ids


def answer_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """Sampled ids as the text a reward sees: stop tokens and special tokens dropped."""
    kept = [int(x) for x in ids if int(x) not in tokenizer.eos_ids]
    return tokenizer.decode(kept, skip_special_tokens=True)


__all__ = ["PromptFormat", "answer_text", "encode_prompt"]
