"""Frozen config dataclasses from YAML files and dotted command-line overrides, and back.

    cfg = load_config(RunConfig, "sft_tiny.yaml", ["optimizer.learning_rate=3e-4", "steps=50"])
    yaml.safe_dump(dump_config(cfg))          # what a run directory records

A YAML file holds a mapping that mirrors the dataclass tree; each override `a.b.c=value` sets one
leaf, its value parsed as a YAML scalar or flow collection (`42`, `true`, `null`, `[128, 256]`,
`bfloat16`). Overrides apply after the file, in order. The tree is then built top-down: every key
must be a field of its dataclass, every value must fit the field's annotation (nested dataclasses,
`Literal`, `tuple[...]`, `X | None`, int / float / bool / str), and each dataclass's own
`__post_init__` checks run. Any failure is a `ConfigError` naming the dotted key path, the value,
and what would be valid (the dataclass's keys, the Literal's choices or the expected type).

A key inside a section changes that key alone: the section starts from the enclosing field's
own default (e.g. `AgenticRunConfig.engine`'s `max_len=512`), not from the section class's
defaults, so defaults live in one place that the loader and the Python constructors share. A
key a config class has renamed (its `RENAMED` mapping, old key -> new dotted key) is refused
with the new name.

Two conveniences, both lossless: a float field takes a string YAML leaves unparsed (PyYAML reads
`1e-5` as a string), and a `tuple[X, ...]` field takes a single scalar as a 1-tuple.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

import yaml

from nonstop.models.validation import ConfigError

T = TypeVar("T")


def load_config(cls: type[T], path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> T:
    """Build `cls` from the YAML file at `path` (None: all defaults) and dotted overrides."""
    raw: Any = {}
    source = "<defaults>"
    if path is not None:
        source = os.fspath(path)
        try:
            with open(source, encoding="utf-8") as handle:
                raw = yaml.safe_load(handle)
        except FileNotFoundError:
            raise ConfigError(f"config file {source} does not exist") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"{source}: not valid YAML ({error})") from None
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{source}: the top level must be a mapping of keys, got {type(raw).__name__}"
            )
    for override in overrides:
        _apply_override(raw, override)
    return _build(cls, raw, "")


def parse_override(override: str) -> tuple[tuple[str, ...], Any]:
    """`"a.b=1"` -> `(("a", "b"), 1)`; the value is parsed as YAML."""
    key, sep, text = override.partition("=")
    keys = tuple(key.strip().split("."))
    if not sep or not all(keys):
        raise ConfigError(
            f"override {override!r} is not of the form key.sub=value (e.g. optimizer.learning_rate=1e-4)"
        )
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({error})") from None
    return keys, value


def dump_config(obj: Any) -> Any:
    """A plain YAML/JSON-ready tree (dicts, lists, scalars) that `load_config` turns back into
    an equal object."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: dump_config(getattr(obj, f.name)) for f in _init_fields(type(obj))}
    if isinstance(obj, tuple | list):
        return [dump_config(item) for item in obj]
    if isinstance(obj, Mapping):
        return {str(key): dump_config(value) for key, value in obj.items()}
    return obj


def _apply_override(raw: dict[str, Any], override: str) -> None:
    keys, value = parse_override(override)
    node = raw
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if not isinstance(child, dict):
            # A None (an unset optional section) or a missing key becomes a section to fill.
            if child is not None and key in node:
                where = ".".join(keys[: depth + 1])
                raise ConfigError(
                    f"override {override!r}: {where} is {child!r}, not a section with sub-keys"
                )
            child = node[key] = {}
        node = child
    node[keys[-1]] = value


@functools.cache
def _init_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.init)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _where(path: str) -> str:
    return path or "<top level>"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _describe(tp: Any) -> str:
    """How a type reads in an error message."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of ({_describe(args[0])})"
        return f"a list of {len(args)} items ({', '.join(_describe(a) for a in args)})"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {[f.name for f in _init_fields(tp)]}"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _fail(path: str, value: Any, tp: Any) -> typing.NoReturn:
    raise ConfigError(f"{_where(path)}={value!r} is invalid; expected {_describe(tp)}")


def _build(tp: Any, value: Any, path: str) -> Any:
    """`value` (from YAML) checked against and converted to the annotation `tp`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path)
    if origin is Literal:
        choices = typing.get_args(tp)
        # `type(...) is` so that True does not pass for 1, nor 1 for 1.0.
        if not any(value == c and type(value) is type(c) for c in choices):
            _fail(path, value, tp)
        return value
    if origin in (Union, types.UnionType):
        return _build_union(tp, value, path)
    if origin is tuple:
        return _build_tuple(tp, value, path)
    if tp is type(None):
        if value is not None:
            _fail(path, value, tp)
        return None
    if tp is bool:
        if not isinstance(value, bool):
            _fail(path, value, tp)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(path, value, tp)
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                _fail(path, value, tp)
        if isinstance(value, bool) or not isinstance(value, int | float):
            _fail(path, value, tp)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(path, value, tp)
        return value
    raise ConfigError(f"{_where(path)}: fields of type {tp!r} cannot be set from a config file")


def _build_union(tp: Any, value: Any, path: str) -> Any:
    members = typing.get_args(tp)
    if value is None:
        if type(None) in members:
            return None
        _fail(path, value, tp)
    candidates = [m for m in members if m is not type(None)]
    # A mapping can only be a dataclass; report that dataclass's own error, which is more precise.
    sections = [m for m in candidates if dataclasses.is_dataclass(m)]
    if isinstance(value, dict) and len(sections) == 1:
        return _build(sections[0], value, path)
    for member in candidates:
        try:
            return _build(member, value, path)
        except ConfigError:
            continue
    _fail(path, value, tp)


def _build_tuple(tp: Any, value: Any, path: str) -> tuple:
    args = typing.get_args(tp)
    homogeneous = len(args) == 2 and args[1] is Ellipsis
    if not isinstance(value, list | tuple):
        if homogeneous and not isinstance(value, dict) and value is not None:
            value = [value]
        else:
            _fail(path, value, tp)
    if homogeneous:
        return tuple(_build(args[0], item, f"{path}[{i}]") for i, item in enumerate(value))
    if len(value) != len(args):
        _fail(path, value, tp)
    return tuple(
        _build(arg, item, f"{path}[{i}]") for i, (arg, item) in enumerate(zip(args, value, strict=False))
    )


def _build_dataclass(cls: type, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        _fail(path, value, cls)
    fields = {f.name: f for f in _init_fields(cls)}
    unknown = [key for key in value if key not in fields]
    renamed = getattr(cls, "RENAMED", {})
    for key in unknown:
        if key in renamed:
            raise ConfigError(f"config key {_join(path, str(key))!r} has moved: set "
                              f"{_join(path, renamed[key])!r} instead")
    if unknown:
        key = _join(path, str(unknown[0]))
        raise ConfigError(
            f"unknown config key {key!r} (value {value[unknown[0]]!r}); valid keys"
            f"{' under ' + path if path else ''}: {sorted(fields)}"
        )
    missing = [
        name
        for name, f in fields.items()
        if name not in value
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(
            f"missing config key {_join(path, missing[0])!r} of {cls.__name__} "
            f"(expected {_describe(_hints(cls)[missing[0]])})"
        )
    hints = _hints(cls)
    kwargs = {key: _build(hints[key], _with_default(fields[key], item), _join(path, key))
              for key, item in value.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as error:  # the dataclass's own __post_init__ checks
        field = getattr(error, "field", None)
        if field is not None:  # said again with the dotted key the user wrote
            again = ConfigError(f"{_join(path, field)}={error.value!r} is invalid; expected "  # type: ignore[attr-defined]
                                f"{error.valid}")  # type: ignore[attr-defined]
            again.field, again.value, again.valid = field, error.value, error.valid  # type: ignore[attr-defined]
            raise again from None
        raise ConfigError(f"{_where(path)}: {error}") from None


def _with_default(field: dataclasses.Field, value: Any) -> Any:
    """A section's keys over the field's own default section (its other keys kept)."""
    default = field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = field.default_factory()  # type: ignore[misc]
    if not isinstance(value, dict) or not dataclasses.is_dataclass(default):
        return value
    return _merge(dump_config(default), value)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, item in top.items():
        below = merged.get(key)
        merged[key] = (_merge(below, item) if isinstance(below, dict) and isinstance(item, dict)
                       else item)
    return merged
