"""Incremental detokenization for streamed text: the text each generated token adds, held back
while it ends in an incomplete UTF-8 sequence, so streamed deltas reassemble to the whole text."""

from __future__ import annotations

from collections.abc import Sequence

from nonstop.models.tokenizer import Tokenizer


class IncrementalText:
    """The text of a growing token list, by incremental detokenization over a short window:
    text is held back while it ends in an incomplete UTF-8 sequence. `ends[i]` is the length of
    `text` once token i was added (a token that completes nothing adds no text)."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.tokens: list[int] = []
        self.ends: list[int] = []
        self.text = ""
        self._prefix = self._read = 0

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self.tokens[start:stop], skip_special_tokens=self._skip)

    def add(self, token: int) -> None:
        self.tokens.append(token)
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self.tokens))
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)
        self.ends.append(len(self.text))

    def finish(self) -> None:
        """Flush what is held back (the generation ended mid-character)."""
        if self._read < len(self.tokens):
            self.text += self._decode(self._prefix, len(self.tokens))[
                len(self._decode(self._prefix, self._read)):]
            self._prefix = self._read = len(self.tokens)
            if self.ends:
                self.ends[-1] = len(self.text)


def text_deltas(tokenizer: Tokenizer, tokens: Sequence[int], *, skip_special_tokens: bool,
                stop: Sequence[str] = ()) -> list[str]:
    """The text each token adds (see `IncrementalText`), cut before the first stop string."""
    text = IncrementalText(tokenizer, skip_special_tokens=skip_special_tokens)
    for token in tokens:
        text.add(token)
    text.finish()
    cut = min((p for s in stop if (p := text.text.find(s)) >= 0), default=len(text.text))
    ends = [min(e, cut) for e in text.ends]
    return [text.text[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


__all__ = ["IncrementalText", "text_deltas"]
