"""A progress line for long prepares: bytes read, MB/s, tokens/s, time left.

On a terminal it redraws one line (``\\r``); otherwise (a log file, a launcher's pipe) it
prints a line every ``LOG_EVERY_S`` seconds. Nothing is printed for work that ends within
``QUIET_S`` seconds, so small runs stay quiet.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

QUIET_S = 2.0
LOG_EVERY_S = 10.0
TTY_EVERY_S = 0.25


def rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def human(n: float) -> str:
    """1234567 -> '1.23M'."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


class Progress:
    """``update(nbytes, tokens)`` as units finish; ``close()`` prints the summary line."""

    def __init__(self, *, total_bytes: int, label: str, stream: TextIO | None = None) -> None:
        self.total = max(total_bytes, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.done_bytes = 0
        self.tokens = 0
        self._last = 0.0
        self._shown = False

    def line(self) -> str:
        took = time.perf_counter() - self.start
        mbs = rate(self.done_bytes / 1e6, took)
        left = (self.total - self.done_bytes) / 1e6 / mbs if mbs else 0.0
        return (
            f"{self.label}: {self.done_bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
            f"({100 * self.done_bytes / self.total:.0f}%), {mbs:,.1f} MB/s, "
            f"{human(rate(self.tokens, took))} tokens/s, {took:.0f}s elapsed, ~{left:.0f}s left"
        )

    def update(self, nbytes: int, tokens: int) -> None:
        self.done_bytes += nbytes
        self.tokens += tokens
        now = time.perf_counter()
        if now - self.start < QUIET_S or now - self._last < (
            TTY_EVERY_S if self.tty else LOG_EVERY_S
        ):
            return
        self._last = now
        self._shown = True
        end = "\r" if self.tty else "\n"
        print(self.line(), end=end, file=self.stream, flush=True)

    def close(self) -> None:
        if self._shown or time.perf_counter() - self.start >= QUIET_S:
            print(self.line().rsplit(", ~", 1)[0], file=self.stream, flush=True)
