"""The one record every doctor check returns, and the verdict of a list of them.

A check looks at facts (gathered elsewhere, or injected by a test) and says ok, warn,
fail or skip (not applicable here, or not checkable), what it found, and what to do.
Checks never print; ``fsdpkit.doctor.check_text`` formats them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail", "skip")


@dataclass(frozen=True)
class Check:
    """The outcome of one check."""

    name: str
    """Short stable id, e.g. "torch", "shm", "env MASTER_PORT", "shared params"."""
    status: Status
    message: str
    """What was found, with the numbers."""
    fix: str = ""
    """What to do about it (empty when there is nothing to do)."""
    section: str = ""
    """Report section ("environment", "model", "network"); set by the runner."""


def ok(name: str, message: str, fix: str = "") -> Check:
    return Check(name, "ok", message, fix)


def warn(name: str, message: str, fix: str = "") -> Check:
    return Check(name, "warn", message, fix)


def fail(name: str, message: str, fix: str = "") -> Check:
    return Check(name, "fail", message, fix)


def skip(name: str, message: str, fix: str = "") -> Check:
    return Check(name, "skip", message, fix)


def counts(checks: Iterable[Check]) -> dict[str, int]:
    """How many checks ended in each status."""
    out: dict[str, int] = dict.fromkeys(STATUSES, 0)
    for c in checks:
        out[c.status] += 1
    return out


def failed(checks: Iterable[Check]) -> bool:
    return any(c.status == "fail" for c in checks)
