"""What rank 0 shows while training: a live bar on a terminal, plain lines otherwise.

Each update shows the step, loss, tokens/s, ETA and every rank's peak memory so far
(min-max past four ranks)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _memory(mem_mib: list[float] | None) -> str:
    if not mem_mib:
        return ""
    if len(mem_mib) <= 4:
        return "  mem " + "/".join(f"{m:,.0f}" for m in mem_mib) + " MiB"
    return f"  mem {min(mem_mib):,.0f}-{max(mem_mib):,.0f} MiB ({len(mem_mib)} ranks)"


class Progress:
    """Step, loss, tokens/s and ETA. ``mode``: bar, lines, none or auto (bar on a tty)."""

    def __init__(
        self, *, total: int, start: int, mode: str, enabled: bool, stream: TextIO | None = None
    ) -> None:
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode if enabled else "none"
        self.total, self.start = total, start
        self.t0 = time.monotonic()
        self.line_every = max(total // 20, 1)

    def update(
        self, *, step: int, loss: float, tokens_per_s: float, mem_mib: list[float] | None = None
    ) -> None:
        """``step`` is the number of completed steps; ``mem_mib`` one peak per rank."""
        if self.mode == "none":
            return
        done = step - self.start
        eta = (time.monotonic() - self.t0) / max(done, 1) * (self.total - step)
        text = (
            f"step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
            f"ETA {_duration(eta)}{_memory(mem_mib)}"
        )
        if self.mode == "bar":
            width = 20
            fill = int(width * step / self.total)
            self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {text}   ")
        elif step % self.line_every == 0 or step == self.total or done == 1:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line that must not be overwritten by the bar (eval results, checkpoints)."""
        if self.mode == "none":
            return
        if self.mode == "bar":
            self.stream.write("\r" + " " * 160 + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.mode == "bar":
            self.stream.write("\n")
            self.stream.flush()
