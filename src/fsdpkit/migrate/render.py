"""A Migration as an fsdpkit TOML file with a comment beside every setting, checked
by loading it back with ``fsdpkit.config``."""

from __future__ import annotations

import tomllib

from fsdpkit import config as configuration
from fsdpkit.config.toml import toml_value
from fsdpkit.migrate.outcome import MigrateError, Migration


def _header(m: Migration) -> list[str]:
    lines = [
        f"# fsdpkit config converted by `fsdpkit migrate` from {m.origin}.",
        "# Every setting says where it came from; '--' notes what differs from the original.",
    ]
    if m.launch:
        lines.append(f"# Launch: {m.launch}")
    lines.append(
        "# Model and data are not part of the original: set [model] (preset, factory or "
        "init_from) and [data] (fsdpkit train --help-config lists every key)."
    )
    if m.dropped:
        lines += ["#", "# Not carried over (no fsdpkit setting):"]
        lines += [f"#   {d.source} -- {d.note}" for d in m.dropped]
    if m.warnings:
        lines += ["#", "# Warnings:"]
        lines += [f"#   {w}" for w in m.warnings]
    return lines


def render(m: Migration) -> str:
    """TOML text: header comments, then one section per config section."""
    lines = _header(m)
    sections: dict[str, list[str]] = {}
    for s in m.settings:
        section, key = s.key.split(".", 1)
        comment = f"  # {s.source}" + (f" -- {s.note}" if s.note else "")
        line = f"{key} = {toml_value(s.value)}{comment}"
        sections.setdefault(section, []).append(f"# {line}" if s.commented else line)
    for section in configuration.SECTIONS:
        if section in sections:
            lines += ["", f"[{section}]", *sections[section]]
    return "\n".join(lines) + "\n"


def validate(text: str, *, origin: str) -> configuration.RunConfig:
    """Load the rendered TOML as ``fsdpkit train`` would; a failure is the converter's
    input's fault (a combination fsdpkit refuses), so it names the origin."""
    try:
        return configuration.from_dict(tomllib.loads(text), source="the converted config")
    except configuration.ConfigError as exc:
        raise MigrateError(f"{origin} converts to a config fsdpkit refuses: {exc}") from None
