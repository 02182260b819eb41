"""A runtime type check of dataclass fields: JSON and TOML give untyped values, so every config
dataclass (model, kernel options, train, data) checks its fields against their annotations here.
Knows no model; the lowest place the configs of every package can import."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, get_args, get_origin

from txl.errors import ConfigError


def check_dataclass_types(obj: Any, where: str = "config") -> None:
    """Raise `ConfigError` naming the first field of `obj` whose value does not match its annotation
    ("config.n_layer must be int, got '12' (str)"). Fields listed in `obj.REGISTRY_FIELDS` are names
    checked against a registry later: here only `str`."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        hint = str if f.name in getattr(obj, "REGISTRY_FIELDS", ()) else hints[f.name]
        if not matches(value, hint):
            raise ConfigError(f"{where}.{f.name} must be {describe(hint)}, got {value!r} ({type(value).__name__})")


def matches(value: Any, tp: Any) -> bool:
    origin = get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return isinstance(value, str) and value in get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, arg) for arg in get_args(tp))
    if tp is type(None):
        return value is None
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(matches(v, args[0]) for v in value)
        return len(args) == len(value) and all(matches(v, a) for v, a in zip(value, args))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if origin is tuple:
        args = get_args(tp)
        return f"a list of {describe(args[0])}" if len(args) == 2 and args[1] is Ellipsis else "a list"
    return getattr(tp, "__name__", str(tp))


def tuples_from_lists(obj: Any) -> None:
    """JSON and TOML give lists where a dataclass declares tuples: convert them in place (frozen too)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, list):
            object.__setattr__(obj, f.name, tuple(value))


__all__ = ["check_dataclass_types", "describe", "matches", "tuples_from_lists"]
