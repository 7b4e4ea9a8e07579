"""Grain pipelines from local JSONL / Parquet files to packed `TrainBatch`es for SFT, DPO and ORPO.

    records ─shuffle(seed)─repeat(epochs)─map(ExampleEncoder)─▶ PackUnits ─PackedBatchDataset─▶
    PackedBatch(batch: TrainBatch, stats: PackingStats)

Example kinds (field names configurable in `DataConfig`):
- `"text"`: {"text": ...}; every token is a target.
- `"prompt_completion"`: {"prompt": ..., "completion": ...}; only completion tokens are targets.
- `"chat"`: {"messages": [{"role": ..., "content": ...}, ...]}; only assistant tokens are
  targets, as marked by the tokenizer's chat template.
- `"preference"`: {"prompt": ..., "chosen": ..., "rejected": ...}; becomes a two-sequence unit
  (prompt + chosen, prompt + rejected), response tokens as targets, packed side by side in one row
  (chosen on odd, rejected on even segment ids; see `nonstop.train.packing`).

Prompt and responses may also be message lists (TRL's conversational format): they are then built
with the chat template by `nonstop.models.conversation.Conversation`, and the targets are the
assistant tokens of the responses only, never those of assistant turns inside the prompt.

Prompt and response are tokenized separately and concatenated, so the boundary never shifts with
the text around it (a BPE merge across it would otherwise make the target depend on the prompt).
Errors name the record's file and line and, for a missing field, the fields the record has.

The iterator of `make_dataset(...)` saves and restores its position with `get_state()` /
`set_state()` (Grain's checkpoint protocol): a resumed run sees the same batches in the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import grain
import jinja2
import numpy as np

from nonstop.models.chat_templates import CHAT_FORMATS, ChatFormat
from nonstop.models.conversation import Conversation
from nonstop.models.tokenizer import Tokenizer
from nonstop.models.validation import check, check_choice, check_int
from nonstop.sft.datasets import SourceRecord, open_source
from nonstop.train.packing import BatchPacker, PackedBatch, PackingConfig, PackUnit, TokenSequence

ExampleKind = Literal["text", "prompt_completion", "chat", "preference"]
EXAMPLE_KINDS: tuple[ExampleKind, ...] = ("text", "prompt_completion", "chat", "preference")
_TEXT = (str, list)  # a string, or a list of chat messages
_TYPE_NAMES = {str: "a string", list: "a list of messages"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the examples are, what they look like, and how they become batches."""

    paths: tuple[str, ...]
    kind: ExampleKind = "text"
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    tools_field: str = "tools"  # optional, for chat examples: tool schemas given to the template
    chat_template: ChatFormat | None = None  # a built-in format, or None: the tokenizer's own
    add_bos: bool = True  # when the tokenizer has a BOS token (chat: the template decides)
    add_eos: bool = True  # after the last target (chat: the template decides)
    shuffle: bool = True
    seed: int = 0
    num_epochs: int | None = 1  # None repeats forever
    read_threads: int = 2
    packing: PackingConfig = dataclasses.field(default_factory=PackingConfig)

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):
            object.__setattr__(self, "paths", (self.paths,))
        object.__setattr__(self, "paths", tuple(str(p) for p in self.paths))
        owner = "DataConfig"
        check(bool(self.paths), owner, "paths", self.paths, "at least one .jsonl or .parquet file")
        check_choice(owner, "kind", self.kind, EXAMPLE_KINDS)
        check(self.chat_template is None or self.chat_template in CHAT_FORMATS, owner,
              "chat_template", self.chat_template, "None (the tokenizer's own template) or one of "
              + ", ".join(map(repr, CHAT_FORMATS)))
        epochs = self.num_epochs
        check(epochs is None or (isinstance(epochs, int) and not isinstance(epochs, bool)
                                 and epochs >= 1),
              owner, "num_epochs", epochs, "None (repeat forever) or an int >= 1")
        check_int(owner, "read_threads", self.read_threads, low=0)
        segments = self.packing.max_segments_per_row
        check(self.kind != "preference" or segments % 2 == 0, owner,
              "packing.max_segments_per_row", segments,
              "an even number for kind='preference' (chosen and rejected share a row)")


def _field(record: SourceRecord, name: str, setting: str, kind: str, types: type | tuple) -> Any:
    if name not in record.fields:
        raise ValueError(
            f"{record.origin}: missing field {name!r} for kind {kind!r}; the record has "
            f"{sorted(record.fields)} (set DataConfig.{setting} to the right one)"
        )
    value = record.fields[name]
    if not isinstance(value, types):
        expected = " or ".join(
            _TYPE_NAMES[t] for t in (types if isinstance(types, tuple) else (types,))
        )
        raise TypeError(
            f"{record.origin}: field {name!r} must be {expected}, got {type(value).__name__}"
        )
    return value


class ExampleEncoder(grain.transforms.Map):
    """Turns one `SourceRecord` into a `PackUnit` of token sequences with loss masks."""

    def __init__(self, config: DataConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._bos = [tokenizer.bos_id] if config.add_bos and tokenizer.bos_id is not None else []
        if config.add_eos and not tokenizer.eos_ids and config.kind != "chat":
            raise ValueError(
                "DataConfig.add_eos=True but the tokenizer has no eos token; set add_eos=False "
                "or give the tokenizer an eos_token"
            )
        self._eos = [tokenizer.eos_ids[0]] if config.add_eos and tokenizer.eos_ids else []

    def map(self, record: SourceRecord) -> PackUnit:
        config = self.config
        kind = config.kind
        if kind == "text":
            text = _field(record, config.text_field, "text_field", kind, str)
            tokens = self._bos + self._encode(text) + self._eos
            return (self._sequence(tokens, np.ones(len(tokens), bool), record),)
        if kind == "chat":
            messages = _field(record, config.messages_field, "messages_field", kind, list)
            return (self._conversation([], messages, record),)
        prompt = _field(record, config.prompt_field, "prompt_field", kind, _TEXT)
        if kind == "prompt_completion":
            responses = [_field(record, config.completion_field, "completion_field", kind, _TEXT)]
        else:
            responses = [
                _field(record, config.chosen_field, "chosen_field", kind, _TEXT),
                _field(record, config.rejected_field, "rejected_field", kind, _TEXT),
            ]
        if any(isinstance(r, list) != isinstance(prompt, list) for r in responses):
            raise TypeError(
                f"{record.origin}: prompt and responses must all be strings or all be message "
                "lists (the conversational format)"
            )
        if isinstance(prompt, list):
            return tuple(self._conversation(prompt, r, record) for r in responses)
        return tuple(self._prompt_response(prompt, r, record) for r in responses)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _prompt_response(self, prompt: str, response: str, record: SourceRecord) -> TokenSequence:
        prompt_ids = self._bos + self._encode(prompt)
        response_ids = self._encode(response) + self._eos
        if not response_ids:
            raise ValueError(f"{record.origin}: the response is empty (no target tokens)")
        mask = np.concatenate([np.zeros(len(prompt_ids), bool), np.ones(len(response_ids), bool)])
        return self._sequence(prompt_ids + response_ids, mask, record)

    def _conversation(
        self, prompt: list[Any], messages: list[Any], record: SourceRecord
    ) -> TokenSequence:
        """Chat-template tokens; targets are the assistant tokens of `messages` (not `prompt`)."""
        tools = record.fields.get(self.config.tools_field)
        try:
            conversation = Conversation(self.tokenizer, self.config.chat_template, tools=tools)
            conversation.append_messages(prompt)
            prompt_length = len(conversation)
            conversation.append_messages(messages)
        except (ValueError, TypeError, KeyError, jinja2.TemplateError) as error:
            raise ValueError(f"{record.origin}: cannot build the conversation: {error}") from None
        mask = np.asarray(conversation.loss_mask, bool)
        mask[:prompt_length] = False
        if not mask.any():
            raise ValueError(f"{record.origin}: the conversation has no assistant tokens to train")
        return self._sequence(conversation.tokens, mask, record)

    @staticmethod
    def _sequence(tokens: list[int], mask: np.ndarray, record: SourceRecord) -> TokenSequence:
        if not tokens:
            raise ValueError(f"{record.origin}: the example tokenizes to no tokens")
        return TokenSequence(
            tokens=np.asarray(tokens, np.int32), loss_mask=mask, origin=record.origin
        )


class _PackedBatchIterator(grain.DatasetIterator):
    """Pulls units from its parent into a `BatchPacker`; checkpointable between batches.

    Right after a batch is emitted the packer holds exactly one unit — the one that did not fit —
    so the state is the parent's state from just before that unit was read: restoring it reads the
    unit again into an empty packer, and the batches that follow are the same.
    """

    def __init__(self, parent: grain.DatasetIterator, config: PackingConfig) -> None:
        super().__init__(parent)
        self._config = config
        self._packer = BatchPacker(config)
        self._held_unit_state: Any = None

    def __next__(self) -> PackedBatch:
        while True:
            before = self._parent.get_state()
            try:
                unit = next(self._parent)
            except StopIteration:
                self._held_unit_state = None
                last = self._packer.finish()
                if last is None:
                    raise
                return last
            packed = self._packer.add(unit)
            if packed is not None:
                self._held_unit_state = before
                return packed

    def get_state(self) -> dict[str, Any]:
        if self._packer.empty:
            return {"parent": self._parent.get_state()}
        return {"parent": self._held_unit_state}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._packer = BatchPacker(self._config)
        self._held_unit_state = None


class PackedBatchDataset(grain.IterDataset):
    """An IterDataset of `PackedBatch`es packed from an IterDataset of `PackUnit`s."""

    def __init__(self, parent: grain.IterDataset, config: PackingConfig) -> None:
        super().__init__(parent)
        self._config = config

    def __iter__(self) -> _PackedBatchIterator:
        return _PackedBatchIterator(self._parent.__iter__(), self._config)

    def __str__(self) -> str:
        return f"PackedBatchDataset(config={self._config})"


def make_dataset(config: DataConfig, tokenizer: Tokenizer) -> grain.IterDataset:
    """The full pipeline: an IterDataset of `PackedBatch`es; `iter()` it to train."""
    sources = [grain.MapDataset.source(open_source(path)) for path in config.paths]
    records = sources[0] if len(sources) == 1 else grain.MapDataset.concatenate(sources)
    if config.shuffle:
        records = records.shuffle(seed=config.seed)
    records = records.repeat(config.num_epochs)
    units = records.map(ExampleEncoder(config, tokenizer))
    options = grain.ReadOptions(
        num_threads=config.read_threads, prefetch_buffer_size=4 * max(config.read_threads, 1)
    )
    return PackedBatchDataset(units.to_iter_dataset(options), config.packing)
