"""The one TOML writer: every config value (and a recommender's changes) is written
here, so what fsdpkit writes is what ``tomllib`` reads back, value for value.

Strings are TOML basic strings with every character that needs it escaped (quotes,
backslashes, control characters); lists become arrays, dicts inline tables; ``None``
has no TOML spelling, so a key whose value is None is written as a comment (reading
the file back leaves it at its default, which is None for every optional field).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _key(name: str) -> str:
    """A bare key where TOML allows one, else a quoted key."""
    bare = name and all(ch.isascii() and (ch.isalnum() or ch in "-_") for ch in name)
    return name if bare else _string(name)


def toml_value(value: Any) -> str:
    """One value in TOML syntax (not None: see the module docstring)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        items = ", ".join(f"{_key(str(k))} = {toml_value(v)}" for k, v in value.items())
        return "{" + items + "}"
    raise TypeError(f"no TOML spelling for {type(value).__name__} {value!r}")


def assignment(key: str, value: Any) -> str:
    """``key = value``, or a comment for None (left at its default when read back)."""
    if value is None:
        return f"# {key} = (empty)"
    return f"{_key(key)} = {toml_value(value)}"


def dump_tables(tables: Mapping[str, Mapping[str, Any]]) -> str:
    """``[section]`` tables of ``key = value`` lines."""
    blocks = []
    for section, values in tables.items():
        lines = [f"[{_key(section)}]", *(assignment(k, v) for k, v in values.items())]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def dotted_tables(changes: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"train.steps": 5}`` -> ``{"train": {"steps": 5}}`` (keys are section.field)."""
    tables: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        section, name = key.split(".", 1)
        tables.setdefault(section, {})[name] = value
    return tables
