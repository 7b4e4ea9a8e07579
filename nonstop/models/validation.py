"""One error type and one message format for every config value nonstop refuses.

    check(cfg.max_len >= 2, "EngineConfig", "max_len", cfg.max_len, "an int >= 2")
    # ConfigError: EngineConfig.max_len=1 is invalid; expected an int >= 2

A `ConfigError` raised this way remembers the field, the value and what would be valid, so the
YAML loader (`nonstop.recipes.config_io`) can say the same thing with the dotted key the user
wrote (`engine.max_len=1 is invalid; expected an int >= 2`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, get_args


class ConfigError(ValueError):
    """A configuration value is missing, unsupported or inconsistent.

    Raised by `invalid`/`check`, it carries `field`, `value` and `valid` (else they are None)."""

    field: str | None = None
    value: Any = None
    valid: str | None = None


def invalid(owner: str, field: str, value: Any, valid: str,
            error: type[ValueError] = ConfigError) -> ValueError:
    """The error for `owner.field = value`, saying what would be valid (of type `error`, e.g. the
    engine's `RequestError` for a request's sampling parameters)."""
    exc = error(f"{owner}.{field}={value!r} is invalid; expected {valid}")
    exc.field, exc.value, exc.valid = field, value, valid  # type: ignore[attr-defined]
    return exc


def check(ok: bool, owner: str, field: str, value: Any, valid: str,
          error: type[ValueError] = ConfigError) -> None:
    """Raise `invalid(owner, field, value, valid, error)` unless `ok`."""
    if not ok:
        raise invalid(owner, field, value, valid, error)


def check_choice(owner: str, field: str, value: Any, choices: Any) -> None:
    """`value` must be one of `choices` (a tuple, or a `Literal` type)."""
    options = get_args(choices) or tuple(choices)
    check(value in options, owner, field, value, "one of " + ", ".join(map(repr, options)))


def check_int(owner: str, field: str, value: Any, *, low: int = 1) -> None:
    """`value` must be an int (not a bool) >= `low`."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    check(ok, owner, field, value, f"an int >= {low}")


def check_ints(owner: str, obj: Any, fields: Iterable[str], *, low: int = 1) -> None:
    """`check_int` for each named field of `obj`."""
    for field in fields:
        check_int(owner, field, getattr(obj, field), low=low)


__all__ = ["ConfigError", "check", "check_choice", "check_int", "check_ints", "invalid"]
