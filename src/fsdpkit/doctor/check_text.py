"""Doctor results as text (one line per check, the fix indented below) and JSON.

Formatting only: every verdict was made by a check.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence
from typing import Any

from fsdpkit.doctor.check import Check, counts

_MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "--  "}
WIDTH = 100


def _wrap(text: str, indent: int) -> list[str]:
    return textwrap.wrap(text, width=WIDTH, initial_indent="", subsequent_indent=" " * indent)


def format_check(check: Check) -> list[str]:
    head = f"  {_MARK[check.status]}  {check.name:<22} "
    lines = _wrap(head + check.message, len(head))
    if check.fix:
        lines += _wrap(" " * len(head) + "-> " + check.fix, len(head) + 3)
    return lines


def format_report(checks: Sequence[Check], *, title: str = "fsdpkit doctor") -> str:
    """Sections in first-seen order, then a one-line summary."""
    lines = [title]
    section = None
    for check in checks:
        if check.section != section:
            section = check.section
            lines += ["", f"{section}:"]
        lines += format_check(check)
    c = counts(checks)
    lines += [
        "",
        f"{c['ok']} ok, {c['warn']} warnings, {c['fail']} failed, {c['skip']} not applicable",
    ]
    return "\n".join(lines)


def report_dict(checks: Sequence[Check], **extra: Any) -> dict[str, Any]:
    """JSON-ready: {"checks": [...], "counts": {...}, "ok": bool, **extra}."""
    c = counts(checks)
    return {
        "ok": c["fail"] == 0,
        "counts": c,
        "checks": [dataclasses.asdict(check) for check in checks],
        **extra,
    }
