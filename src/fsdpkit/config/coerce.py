"""Checking TOML / command-line values against the config's type annotations.

A small engine over ``typing``: unions (``int | None``), ``Literal`` choices, lists,
and plain scalars (ints widen to floats). Errors name the dotted key, say what was
expected and suggest the closest valid key or choice.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Literal

from fsdpkit.errors import ConfigError


def suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else f" Valid: {', '.join(options)}."


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "empty"
    return getattr(tp, "__name__", str(tp)) if typing.get_origin(tp) is None else str(tp)


def _is_union(tp: Any) -> bool:
    return isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union


def _coerce_union(key: str, value: Any, tp: Any) -> Any:
    if value is None and type(None) in typing.get_args(tp):
        return None
    for arg in typing.get_args(tp):
        if arg is type(None):
            continue
        try:
            return _coerce(key, value, arg)
        except ConfigError:
            pass
    raise _wrong_type(key, value, tp)


def _coerce_literal(key: str, value: Any, tp: Any) -> Any:
    if value in typing.get_args(tp):
        return value
    options = [str(a) for a in typing.get_args(tp)]
    raise ConfigError(f"{key} = {value!r} is not a valid choice.{suggest(str(value), options)}")


def _coerce_list(key: str, value: Any, tp: Any) -> Any:
    (item_tp,) = typing.get_args(tp)
    if isinstance(value, str):  # key=a,b on the command line
        value = [v for v in value.split(",") if v]
    if not isinstance(value, list):
        raise _wrong_type(key, value, tp)
    return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]


def _wrong_type(key: str, value: Any, tp: Any) -> ConfigError:
    return ConfigError(
        f"{key} = {value!r} has the wrong type: expected {type_name(tp)}. "
        f"Fix the value in the TOML file or the override (e.g. {key}=<{type_name(tp)}>)."
    )


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; returns it (ints widened to float)."""
    if _is_union(tp):
        return _coerce_union(key, value, tp)
    if typing.get_origin(tp) is Literal:
        return _coerce_literal(key, value, tp)
    if typing.get_origin(tp) is list:
        return _coerce_list(key, value, tp)
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if tp is float and is_number:
        return float(value)
    if (tp is int and is_number and isinstance(value, int)) or (
        tp in (str, bool) and isinstance(value, tp)
    ):
        return value
    raise _wrong_type(key, value, tp)


def build_section(name: str, cls: type, values: dict[str, Any], *, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = list(hints)
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(
                f"unknown key {name}.{key} in {source}.{suggest(key, known)} "
                "Run `fsdpkit train --help-config` for every key."
            )
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)
