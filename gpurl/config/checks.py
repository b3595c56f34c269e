"""Checks the config schemas (`gpurl.config`) run on their values, and the error a user
who set a bad value gets: one sentence naming the key and the fix. A leaf module."""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any


class ConfigError(ValueError):
    """A config value a user set is invalid; the message names the key and the fix."""


DTYPES = ("float32", "bfloat16", "float16")

_EnumT = typing.TypeVar("_EnumT", bound=enum.Enum)


def choice(key: str, value: str, choices: tuple[str, ...] | type[enum.Enum]) -> None:
    names = tuple(c.value for c in choices) if isinstance(choices, type) else choices
    if value not in names:
        raise ConfigError(f"{key}={value!r} is not valid; use one of: {', '.join(names)}.")


_ValueT = typing.TypeVar("_ValueT")


def lookup(table: typing.Mapping[str, _ValueT], value: str, key: str) -> _ValueT:
    """`table[value]` for the config key `key`; a missing value is one sentence naming the
    valid ones (registries of algorithms and model families)."""
    try:
        return table[value]
    except KeyError:
        raise ConfigError(f"{key}={value!r} is not valid; use one of: "
                          f"{', '.join(table)}.") from None


def enum_field(obj: Any, name: str, key: str, choices: type[_EnumT]) -> None:
    """Checks field `name` of a frozen dataclass against `choices` and stores the member."""
    value = getattr(obj, name)
    choice(key, value, choices)
    object.__setattr__(obj, name, choices(value))


def positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value} is not valid; set it to a number {bound}.")


def tuplify(obj: Any) -> None:
    """Frozen dataclasses hold tuples, not the lists omegaconf produces."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, list):
            object.__setattr__(obj, f.name, tuple(value))
        elif isinstance(value, dict):
            object.__setattr__(
                obj, f.name,
                {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})
