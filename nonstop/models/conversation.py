"""Conversation: token-level, prefix-stable chat building for rollouts and SFT data.

A Conversation holds a chat's token ids with, per token, its turn's role and a loss mask.
Appending never changes a token already there: new messages add only the text the chat template
adds for them, and model output is appended as the sampled ids, never re-tokenized.
`append_model_tokens(ids)` adds sampled ids (mask True on exactly those); an assistant `Message`
in `append_messages` (SFT data) gets the same tokens and mask as if the model had sampled it.
Templates that look ahead (grouped tool results, Qwen3 dropping earlier reasoning) raise an error
that says so. When the tokens equal `tokenizer.encode(template.render(messages))`, and the mask
in detail: docs/models.md, "Chat templates and conversations".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nonstop.models.chat import ChatTemplate, Message, Role, ToolSchema, normalize_message
from nonstop.models.chat_templates import BUILTIN_TEMPLATES
from nonstop.models.tokenizer import Tokenizer

# Stands in for the assistant's content when asking the template what surrounds a turn; private-use
# characters, so no real content contains it.
_SENTINEL = "\ue000nonstop-assistant-content\ue001"


class Conversation:
    """Token ids of one chat, with per-token role and loss mask; append-only."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: ChatTemplate | str | None = None,
        *,
        tools: Sequence[ToolSchema] | None = None,
        variables: Mapping[str, Any] | None = None,
    ):
        """`template`: a ChatTemplate, a built-in format name ("llama3", "qwen", "gemma"), or None
        for the tokenizer's own template. `tools` and `variables` are passed to every render."""
        if template is None:
            template = ChatTemplate.from_tokenizer(tokenizer, tools=tools is not None)
        elif isinstance(template, str):
            if template not in BUILTIN_TEMPLATES:
                raise ValueError(
                    f"template must be a ChatTemplate, None or one of {tuple(BUILTIN_TEMPLATES)}, "
                    f"got {template!r}"
                )
            template = ChatTemplate.builtin(template, special_tokens=tokenizer.special_tokens)
        self._tokenizer = tokenizer
        self._template = template
        self._tools = None if tools is None else list(tools)
        self._variables = dict(variables or {})
        self._stop_ids = frozenset(tokenizer.eos_ids)
        self._special_ids = tokenizer.special_ids
        self._messages: list[dict[str, Any]] = []
        self._text = ""  # the template's rendering of self._messages ("" before the first)
        self._tokens: list[int] = []
        self._roles: list[Role] = []
        self._loss_mask: list[bool] = []
        self._frame: tuple[list[int], list[int]] | None = None

    @classmethod
    def from_messages(
        cls,
        tokenizer: Tokenizer,
        template: ChatTemplate | str | None,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        tools: Sequence[ToolSchema] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> Conversation:
        conversation = cls(tokenizer, template, tools=tools, variables=variables)
        conversation.append_messages(messages)
        return conversation

    # ---------------------------------------------------------------- views

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def roles(self) -> list[Role]:
        """Per token, the role of the turn that wrote it (template scaffolding included)."""
        return list(self._roles)

    @property
    def loss_mask(self) -> list[bool]:
        """Per token, True exactly on assistant tokens: sampled ids, or assistant text given."""
        return list(self._loss_mask)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The messages as the template saw them (model turns as their decoded text)."""
        return [dict(m) for m in self._messages]

    @property
    def template(self) -> ChatTemplate:
        return self._template

    def __len__(self) -> int:
        return len(self._tokens)

    # ---------------------------------------------------------------- appending

    def append_messages(self, messages: Sequence[Message | Mapping[str, Any]]) -> list[int]:
        """Append messages and return the ids added. Runs of non-assistant messages are rendered and
        tokenized together; give all tool results of one assistant turn in one call."""
        added_from = len(self._tokens)
        normalized = [normalize_message(m, len(self._messages) + i) for i, m in enumerate(messages)]
        saved = (len(self._tokens), len(self._messages), self._text)
        try:
            run: list[dict[str, Any]] = []
            for message in normalized:
                if message.get("role") == "assistant":
                    self._append_run(run)
                    run = []
                    self._append_assistant(message)
                else:
                    run.append(message)
            self._append_run(run)
        except Exception:
            self._restore(*saved)  # all or nothing
            raise
        return self._tokens[added_from:]

    def generation_prompt_tokens(self) -> list[int]:
        """The full prompt for the next assistant turn: the tokens so far plus the template's
        generation-prompt header. Nothing is appended."""
        header, _ = self._assistant_frame()
        return self._tokens + header

    def append_model_tokens(self, ids: Sequence[int]) -> list[int]:
        """Append one assistant turn the model sampled: the generation-prompt header, `ids`
        verbatim (loss_mask True), then the rest of the template's closing text. A turn that ends
        in a stop id (eos_ids or the template's end-of-turn token) is closed by it; otherwise the
        whole closing text, end-of-turn token first, is appended."""
        ids = [int(i) for i in ids]
        if not all(0 <= i < self._tokenizer.vocab_size for i in ids):
            raise ValueError(
                f"model token ids must lie in [0, {self._tokenizer.vocab_size}), got {ids}"
            )
        added_from = len(self._tokens)
        header, close = self._assistant_frame()
        end_of_turn = close[0] if close and close[0] in self._special_ids else None
        stops = self._stop_ids | ({end_of_turn} if end_of_turn is not None else set())
        closed = bool(ids) and ids[-1] in stops
        content = self._tokenizer.decode(ids[:-1] if closed else ids)
        message = {"role": "assistant", "content": content}
        delta = self._delta(self._render([*self._messages, message]), "the model's turn")
        self._extend(header, "assistant", False)
        self._extend(ids, "assistant", True)
        # The model's stop id stands in for the end-of-turn token; the text after it is ours.
        self._extend(close[1:] if closed and end_of_turn is not None else close, "assistant", False)
        self._text += delta
        self._messages.append(message)
        self._frame = None
        return self._tokens[added_from:]

    # ---------------------------------------------------------------- internals

    def _render(
        self, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool = False
    ) -> str:
        return self._template.render(
            messages,
            tools=self._tools,
            add_generation_prompt=generation_prompt,
            variables=self._variables,
        )

    def _restore(self, n_tokens: int, n_messages: int, text: str) -> None:
        del self._tokens[n_tokens:], self._roles[n_tokens:], self._loss_mask[n_tokens:]
        del self._messages[n_messages:]
        self._text = text
        self._frame = None

    def _extend(self, ids: Sequence[int], role: Role, trainable: bool) -> None:
        self._tokens.extend(ids)
        self._roles.extend([role] * len(ids))
        self._loss_mask.extend([trainable] * len(ids))

    def _delta(self, rendered: str, what: str) -> str:
        """The text `rendered` adds to the conversation so far; refuses a rewrite of earlier text."""
        if not rendered.startswith(self._text):
            at = next(
                (i for i, (a, b) in enumerate(zip(rendered, self._text, strict=False)) if a != b),
                min(len(rendered), len(self._text)),
            )
            raise ValueError(
                f"the chat template is not prefix-stable here: rendering {what} changes the text "
                f"already tokenized at character {at} (was {self._text[at : at + 40]!r}, now "
                f"{rendered[at : at + 40]!r}). Append consecutive tool results in one "
                f"append_messages call; templates that rewrite earlier turns cannot be built "
                f"incrementally."
            )
        return rendered[len(self._text) :]

    def _append_run(self, run: list[dict[str, Any]]) -> None:
        """Render a run of non-assistant messages, tokenize the added text in one piece and give
        each token the role of the message whose text it starts in."""
        if not run:
            return
        roles = [m.get("role", "user") for m in run]
        delta = self._delta(self._render(self._messages + run), f"{roles} messages")
        starts = [0]
        for i in range(1, len(run)):
            partial = self._render(self._messages + run[:i])
            # A grouped rendering (tool results) is no prefix; such messages share the start.
            ok = partial.startswith(self._text) and delta.startswith(partial[len(self._text) :])
            starts.append(len(partial) - len(self._text) if ok else starts[-1])
        ids, offsets = self._tokenizer.encode_with_offsets(delta)
        for token_id, (begin, _) in zip(ids, offsets, strict=True):
            owner = max(i for i, start in enumerate(starts) if start <= begin)
            self._extend([token_id], _as_role(roles[owner]), False)
        self._messages.extend(run)
        self._text += delta
        self._frame = None

    def _append_assistant(self, message: dict[str, Any]) -> None:
        """An assistant turn given as text: header | body (trainable) | closing text."""
        header_text, close_text = self._assistant_frame_text()
        delta = self._delta(self._render([*self._messages, message]), "an assistant message")
        if not (
            delta.startswith(header_text)
            and delta.endswith(close_text)
            and len(delta) >= len(header_text) + len(close_text)
        ):
            raise ValueError(
                "the chat template renders this assistant message as "
                f"{delta!r}, which does not start with its generation prompt {header_text!r} and "
                f"end with its closing text {close_text!r}; nonstop cannot tell its tokens apart"
            )
        body = delta[len(header_text) : len(delta) - len(close_text)]
        header, close = self._assistant_frame()
        self._extend(header, "assistant", False)
        self._extend(self._tokenizer.encode(body), "assistant", True)
        trained_end = 1 if close and close[0] in self._special_ids else 0
        self._extend(close[:trained_end], "assistant", True)
        self._extend(close[trained_end:], "assistant", False)
        self._messages.append(message)
        self._text += delta
        self._frame = None

    def _assistant_frame_text(self) -> tuple[str, str]:
        """(generation-prompt header, closing text) of the next assistant turn, found by rendering
        an assistant message whose content is a sentinel."""
        with_prompt = self._render(self._messages, generation_prompt=True)
        header = self._delta(with_prompt, "the generation prompt")
        with_turn = self._render([*self._messages, {"role": "assistant", "content": _SENTINEL}])
        turn = self._delta(with_turn, "an assistant turn")
        if _SENTINEL not in turn or not turn.startswith(header):
            raise ValueError(
                f"the chat template's assistant turn {turn!r} does not begin with its generation "
                f"prompt {header!r}; model output cannot be appended after that prompt"
            )
        return header, turn[turn.index(_SENTINEL) + len(_SENTINEL) :]

    def _assistant_frame(self) -> tuple[list[int], list[int]]:
        if self._frame is None:
            header_text, close_text = self._assistant_frame_text()
            self._frame = (self._tokenizer.encode(header_text), self._tokenizer.encode(close_text))
        return self._frame


_ROLE_ALIASES: dict[str, Role] = {"ipython": "tool", "function": "tool", "developer": "system"}


def _as_role(role: str) -> Role:
    """Roles of checkpoint templates mapped onto nonstop's four (unknown ones count as user)."""
    if role in ("system", "user", "assistant", "tool"):
        return role  # type: ignore[return-value]
    return _ROLE_ALIASES.get(role, "user")
