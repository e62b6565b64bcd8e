"""What a migration produces: fsdpkit settings, each with where it came from and what
changed, the inputs with no equivalent, and warnings (conflicts, unknown keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdpkit.errors import UserError


class MigrateError(UserError, ValueError):
    """The input cannot be converted; the message names the key and the fix."""


@dataclass(frozen=True)
class Setting:
    """One fsdpkit config key to write."""

    key: str
    """Dotted fsdpkit key, e.g. "parallel.strategy"."""
    value: Any
    source: str
    """The input it came from, e.g. "fsdp_sharding_strategy: HYBRID_SHARD"."""
    note: str = ""
    """What differs from the input's meaning; empty when the meaning is the same."""
    commented: bool = False
    """Written as a comment only (the input tool ignored it too)."""


@dataclass(frozen=True)
class Dropped:
    """An input setting with no fsdpkit key."""

    source: str
    note: str


@dataclass
class Migration:
    """Settings collected while reading one input."""

    origin: str
    settings: list[Setting] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    launch: str = ""
    """Suggested launch command (Accelerate's process layout)."""

    def set(
        self, key: str, value: Any, source: str, note: str = "", *, commented: bool = False
    ) -> None:
        """Add a setting; a later one for the same key replaces the earlier."""
        self.settings = [s for s in self.settings if s.key != key or s.commented]
        self.settings.append(Setting(key, value, source, note, commented))

    def drop(self, source: str, note: str) -> None:
        self.dropped.append(Dropped(source, note))

    def value(self, key: str, default: Any = None) -> Any:
        for s in self.settings:
            if s.key == key and not s.commented:
                return s.value
        return default
