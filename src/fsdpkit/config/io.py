"""Reading and writing configs: TOML files, dotted overrides, programmatic changes.

    load("run.toml", ["train.steps=50"])              # file + command-line overrides
    with_changes(cfg, {"parallel.strategy": "hybrid"})  # what parallel.auto and the
                                                         # recommender apply
    to_toml(cfg)                                        # reads back to an equal config

Overrides, the recommender and ``parallel.auto`` all change a config through
``apply_dotted`` on its section dicts, so every change is type-checked and validated
the same way.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fsdpkit.config.coerce import build_section, suggest
from fsdpkit.config.schema import SECTIONS, RunConfig
from fsdpkit.config.toml import dump_tables
from fsdpkit.config.validate import validate
from fsdpkit.errors import ConfigError


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` -> ("a.b", value); the value is read as TOML, else as a string."""
    if "=" not in text:
        raise ConfigError(
            f"override {text!r} is not key=value. Write e.g. train.steps=50 "
            "(dotted key, '=', value)."
        )
    key, raw = text.split("=", 1)
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"] if raw else None
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def apply_dotted(data: Mapping[str, Any], changes: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """A copy of the section dicts ``data`` with each ``("section.field", value)`` set."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    for key, value in changes:
        path = key.split(".")
        if len(path) != 2:
            raise ConfigError(
                f"{key!r}: keys are section.field (e.g. train.steps=50); "
                f"sections: {', '.join(SECTIONS)}."
            )
        section = out.setdefault(path[0], {})
        if not isinstance(section, dict):
            raise ConfigError(f"{path[0]} is a section, not a value")
        section[path[1]] = value
    return out


def from_dict(data: Mapping[str, Any], *, source: str = "the config") -> RunConfig:
    """Build and validate a RunConfig from nested section dicts."""
    sections = {}
    for name, values in data.items():
        if name not in SECTIONS:
            raise ConfigError(
                f"unknown section [{name}] in {source}.{suggest(name, list(SECTIONS))}"
            )
        if not isinstance(values, Mapping):
            raise ConfigError(f"[{name}] in {source} must be a table of key = value lines")
        sections[name] = build_section(name, SECTIONS[name], dict(values), source=source)
    cfg = RunConfig(**sections)
    validate(cfg)
    return cfg


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file's tables; a missing or malformed file is a ConfigError naming it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"config file {str(p)!r} does not exist. Pass an existing TOML file, or "
            "none to use the built-in default."
        )
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {exc}") from None


def load(path: str | Path | None = None, overrides: Iterable[str] | None = None) -> RunConfig:
    """Read a TOML file (optional) and apply ``key=value`` overrides."""
    data = read_toml(path) if path is not None else {}
    source = str(path) if path is not None else "the command line"
    changes = [parse_override(text) for text in overrides or []]
    return from_dict(apply_dotted(data, changes), source=source)


def with_changes(
    cfg: RunConfig, changes: Mapping[str, Any], *, source: str = "the changes"
) -> RunConfig:
    """``cfg`` with dotted keys set (``None`` empties an optional key), type-checked
    and validated like a file."""
    return from_dict(apply_dotted(cfg.to_dict(), changes.items()), source=source)


def to_toml(cfg: RunConfig) -> str:
    """The config as TOML that ``load`` reads back to an equal RunConfig."""
    return dump_tables(cfg.to_dict())
