"""Tokenizer: a Hugging Face `tokenizers` tokenizer plus the special tokens and chat template of its
checkpoint directory.

`Tokenizer.from_pretrained(path)` reads what transformers' `AutoTokenizer` reads from a local
directory (tokenizer.json, tokenizer_config.json, chat_template.jinja, chat_templates/*.jinja) and
the end-of-sequence ids of generation_config.json / config.json, and encodes and decodes exactly as
transformers' fast tokenizer does. `save_pretrained` writes a directory AutoTokenizer can load.

Whether encode(add_special_tokens=True) adds a BOS/EOS is decided by tokenizer.json's post-processor
alone; transformers 5 ignores tokenizer_config.json's add_bos_token/add_eos_token when tokenizer.json
exists, and so does nonstop.

Where it departs from transformers: a special token named in tokenizer_config.json that
tokenizer.json lacks is an error here, where transformers would silently grow the vocabulary past the
model's embedding table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

# The named special tokens transformers exposes as `tokenizer.special_tokens_map`, in its order;
# chat templates see each one as a variable of the same name.
SPECIAL_TOKEN_NAMES: tuple[str, ...] = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Keys under which tokenizer_config.json lists further special tokens (transformers 4 and 5).
_EXTRA_SPECIAL_KEYS: tuple[str, ...] = ("additional_special_tokens", "extra_special_tokens")

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "chat_templates"


def _token_text(value: Any, *, key: str, config_file: Path) -> str | None:
    """A special token given as a string or as a serialized AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"{config_file}: {key} must be a string or an AddedToken dict with 'content', got {value!r}"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _eos_ids_from(path: Path) -> list[int]:
    """eos_token_id of a generation_config.json / config.json: an int, a list of ints, or absent."""
    if not path.is_file():
        return []
    value = _read_json(path).get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return values


def _read_chat_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named chat templates; jinja files take precedence over tokenizer_config.json, as in
    transformers."""
    config_file = directory / TOKENIZER_CONFIG_FILE
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if not (
                isinstance(entry, Mapping)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise ValueError(
                    f"{config_file}: chat_template list entries must be {{'name': str, "
                    f"'template': str}}, got {entry!r}"
                )
            templates[entry["name"]] = entry["template"]
    elif raw is not None:
        raise ValueError(
            f"{config_file}: chat_template must be a string or a list of {{name, template}}, "
            f"got {type(raw).__name__}"
        )
    jinja_templates: dict[str, str] = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        jinja_templates["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for file in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            jinja_templates[file.stem] = file.read_text(encoding="utf-8")
    # transformers replaces the config's templates wholesale when any jinja file exists.
    return jinja_templates or templates


class Tokenizer:
    """Text <-> token ids for one checkpoint, with its special tokens and chat templates."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        extra_special_tokens: Sequence[str] = (),
        chat_templates: Mapping[str, str] | None = None,
        extra_eos_ids: Sequence[int] = (),
        config: Mapping[str, Any] | None = None,
        source: str = "<in memory>",
    ):
        """`special_tokens` maps names in SPECIAL_TOKEN_NAMES to token strings; `config` is the rest
        of tokenizer_config.json, kept so `save_pretrained` preserves it; `source` names the files
        in error messages."""
        self._backend = backend
        self._config = dict(config or {})
        special_tokens = dict(special_tokens or {})
        for name, token in special_tokens.items():
            if name not in SPECIAL_TOKEN_NAMES:
                raise ValueError(
                    f"unknown special token name {name!r}; valid: {SPECIAL_TOKEN_NAMES}"
                )
            if backend.token_to_id(token) is None:
                raise ValueError(
                    f"{source}: {name} {token!r} is not a token of the vocabulary "
                    f"(tokenizer.json has no such token)"
                )
        for token in extra_special_tokens:
            if backend.token_to_id(token) is None:
                raise ValueError(
                    f"{source}: extra special token {token!r} is not a token of the vocabulary"
                )
        self._special_tokens = {
            n: special_tokens[n] for n in SPECIAL_TOKEN_NAMES if n in special_tokens
        }
        self._extra_special_tokens = tuple(extra_special_tokens)
        # transformers registers every named special token as special, so decode() skips them.
        self._backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t in (*self._special_tokens.values(), *self._extra_special_tokens)
                if not self._is_special(t)
            ]
        )
        # Per-call settings in transformers: no truncation or padding unless asked for.
        self._backend.no_truncation()
        self._backend.no_padding()
        self._chat_templates = dict(chat_templates or {})
        eos_ids: list[int] = []
        if "eos_token" in self._special_tokens:
            eos_ids.append(self.token_to_id(self._special_tokens["eos_token"]))
        for token_id in extra_eos_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"{source}: eos_token_id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )
            if token_id not in eos_ids:
                eos_ids.append(token_id)
        self._eos_ids = tuple(eos_ids)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a local Hugging Face tokenizer directory (no downloads)."""
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"tokenizer directory {directory} does not exist")
        tokenizer_file = directory / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: nonstop needs a fast tokenizer (tokenizer.json); "
                f"convert a slow tokenizer with transformers' AutoTokenizer(...).save_pretrained()"
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config_file = directory / TOKENIZER_CONFIG_FILE
        config = _read_json(config_file) if config_file.is_file() else {}
        for token_id, entry in config.get("added_tokens_decoder", {}).items():
            content = _token_text(
                entry, key=f"added_tokens_decoder[{token_id}]", config_file=config_file
            )
            if backend.token_to_id(content) != int(token_id):
                raise ValueError(
                    f"{config_file}: added_tokens_decoder names {content!r} as id {token_id}, but "
                    f"{tokenizer_file} gives it id {backend.token_to_id(content)}"
                )
            if isinstance(entry, Mapping) and entry.get("special"):
                backend.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        special_tokens = {}
        for name in SPECIAL_TOKEN_NAMES:
            token = _token_text(config.get(name), key=name, config_file=config_file)
            if token is not None:
                special_tokens[name] = token
        extra: list[str] = []
        for key in _EXTRA_SPECIAL_KEYS:
            values = config.get(key) or []
            if isinstance(values, Mapping):  # transformers 5 may write {name: token}
                values = list(values.values())
            extra += [_token_text(v, key=key, config_file=config_file) for v in values]
        extra_eos_ids = _eos_ids_from(directory / "generation_config.json")
        extra_eos_ids += _eos_ids_from(directory / "config.json")
        return cls(
            backend,
            special_tokens=special_tokens,
            extra_special_tokens=[t for t in extra if t is not None],
            chat_templates=_read_chat_templates(directory, config),
            extra_eos_ids=extra_eos_ids,
            config=config,
            source=str(config_file),
        )

    # ---------------------------------------------------------------- encode / decode

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a BOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` (no special tokens added) and each token's character span in it."""
        encoding = self._backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise KeyError(f"{token!r} is not a token of this tokenizer's vocabulary")
        return token_id

    def id_to_token(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise KeyError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        return token

    # ---------------------------------------------------------------- vocabulary facts

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (transformers' `len(tokenizer)`): the smallest
        embedding table that covers every id this tokenizer produces."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens (bos_token, eos_token, ...) as transformers' special_tokens_map."""
        return dict(self._special_tokens)

    @property
    def bos_id(self) -> int | None:
        token = self._special_tokens.get("bos_token")
        return None if token is None else self.token_to_id(token)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The eos_token's id first, then further stop ids from generation_config.json/config.json."""
        return self._eos_ids

    @property
    def pad_id(self) -> int | None:
        token = self._special_tokens.get("pad_token")
        return None if token is None else self.token_to_id(token)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of every added token marked special (what decode(skip_special_tokens=True) drops)."""
        return frozenset(
            i for i, t in self._backend.get_added_tokens_decoder().items() if t.special
        )

    def _is_special(self, token: str) -> bool:
        token_id = self._backend.token_to_id(token)
        added = self._backend.get_added_tokens_decoder().get(token_id)
        return added is not None and added.special

    # ---------------------------------------------------------------- chat templates

    @property
    def chat_templates(self) -> dict[str, str]:
        """All named chat templates ("default", "tool_use", ...)."""
        return dict(self._chat_templates)

    @property
    def chat_template(self) -> str | None:
        """The default chat template, or None."""
        return self._chat_templates.get("default")

    def get_chat_template(self, name: str | None = None, *, tools: bool = False) -> str:
        """The template transformers' apply_chat_template would pick: `name` if given, else
        "tool_use" when tools are passed and it exists, else "default"."""
        if name is None:
            name = "tool_use" if tools and "tool_use" in self._chat_templates else "default"
        if name not in self._chat_templates:
            raise ValueError(
                f"this tokenizer has no chat template named {name!r}; it has "
                f"{sorted(self._chat_templates) or 'none'}"
            )
        return self._chat_templates[name]

    def with_chat_template(self, template: str | Mapping[str, str]) -> Tokenizer:
        """A copy of this tokenizer with its chat template(s) replaced."""
        templates = {"default": template} if isinstance(template, str) else dict(template)
        return Tokenizer(
            tokenizers.Tokenizer.from_str(self._backend.to_str()),
            special_tokens=self._special_tokens,
            extra_special_tokens=self._extra_special_tokens,
            chat_templates=templates,
            extra_eos_ids=self._eos_ids,
            config=self._config,
        )

    # ---------------------------------------------------------------- saving

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """Write tokenizer.json and tokenizer_config.json (chat templates included) so that both
        `Tokenizer.from_pretrained` and transformers' `AutoTokenizer.from_pretrained` load them.
        Stop ids beyond eos_token belong to generation_config.json and are not written here."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / TOKENIZER_FILE))
        config = dict(self._config)
        for key in (*SPECIAL_TOKEN_NAMES, *_EXTRA_SPECIAL_KEYS, "chat_template"):
            config.pop(key, None)
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config.setdefault("clean_up_tokenization_spaces", False)
        config["added_tokens_decoder"] = {
            str(token_id): {
                "content": token.content,
                "lstrip": token.lstrip,
                "normalized": token.normalized,
                "rstrip": token.rstrip,
                "single_word": token.single_word,
                "special": token.special,
            }
            for token_id, token in sorted(self._backend.get_added_tokens_decoder().items())
        }
        config.update(self._special_tokens)
        if self._extra_special_tokens:
            config["additional_special_tokens"] = list(self._extra_special_tokens)
        if list(self._chat_templates) == ["default"]:
            config["chat_template"] = self._chat_templates["default"]
        elif self._chat_templates:
            config["chat_template"] = [
                {"name": name, "template": text} for name, text in self._chat_templates.items()
            ]
        with open(directory / TOKENIZER_CONFIG_FILE, "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2, ensure_ascii=False)
            handle.write("\n")
        # A jinja file would shadow the config's template on load; keep it in step if present.
        stale = directory / CHAT_TEMPLATE_FILE
        if stale.is_file():
            if self.chat_template is None:
                stale.unlink()
            else:
                stale.write_text(self.chat_template, encoding="utf-8")
        return directory

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={self.eos_ids}, "
            f"pad_id={self.pad_id}, chat_templates={sorted(self._chat_templates)})"
        )
