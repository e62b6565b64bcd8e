"""Where each SFT row starts and what it holds: the one pass over every example.

[Note: layout in windows]
The rows of a dataset are laid out window by window of ``WINDOW`` examples, so the
temporaries of the whole-array arithmetic are bounded by the window, not the dataset.
Small windows matter beyond their own bytes: glibc serves blocks above its mmap
threshold (128 KiB) with ``mmap`` and, when such a block is freed, raises the threshold
to its size. One whole-dataset layout (arrays of millions of int64) therefore moved
every later activation tensor of that size onto the heap, which is not returned after
the step: measured on a 100 MB SFT dataset, 2 ranks, a first start held ~130 MB more
RSS after step 1 than a start that mapped a saved layout (fsdpkit's arrays were long
freed). With windows of 4,096 examples every temporary stays under the threshold.
Packing is greedy from each row's first example, so a row that ends inside a
window is final; only the window's last row may continue past it, and when it touches
the window's end it is laid out again as the first row of the next window, which starts
at that row's first example. A row holds at most ``length`` examples (each has at
least one token), so a window of more than ``length`` examples always finishes a row.
The rows go to a file as they are made (then are mapped), or to memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fsdpkit.data.stream import DocEnds, TokenStream

WINDOW = 4096
"""Examples laid out per window ([Note: layout in windows])."""
ROW_FIELDS = 3


@dataclass(frozen=True)
class PackStats:
    """What packing did (reported at the start of the run)."""

    examples: int
    rows: int
    truncated: int
    dropped: int
    target_tokens: int
    tokens: int

    def describe(self, *, seq_len: int, packed: bool) -> str:
        how = "packed into" if packed else "one per row:"
        fill = 100 * self.tokens / max(self.rows * (seq_len + 1), 1)
        text = (
            f"{self.examples:,} examples {how} {self.rows:,} rows of {seq_len} (tokens "
            f"{fill:.0f}% of the rows, {self.target_tokens:,} answer tokens)"
        )
        if self.truncated:
            text += (
                f"; {self.truncated:,} example(s) longer than data.seq_len + 1 = {seq_len + 1} "
                "tokens truncated"
            )
        if self.dropped:
            text += f"; {self.dropped:,} dropped (no answer token left after truncation)"
        return text

    def plus(self, other: PackStats) -> PackStats:
        return PackStats(
            *(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other)))
        )


NO_ROWS = PackStats(0, 0, 0, 0, 0, 0)


@dataclass(frozen=True)
class Layout:
    """Where each row starts in the stream, its tokens and its answer tokens."""

    rows: np.ndarray
    """(rows, 3) int64: start offset, tokens, answer tokens (in memory or mapped)."""
    stats: PackStats

    @classmethod
    def load(cls, path: Path) -> Layout | None:
        """A saved layout, mapped (None when there is none or it is incomplete)."""
        try:
            stats = PackStats(**json.loads(path.with_suffix(".json").read_text()))
            if path.stat().st_size != stats.rows * ROW_FIELDS * 8:
                return None
            if not stats.rows:
                return cls(np.empty((0, ROW_FIELDS), dtype=np.int64), stats)
            rows = np.memmap(path, dtype=np.int64, mode="r", shape=(stats.rows, ROW_FIELDS))
        except (OSError, ValueError, TypeError):
            return None
        return cls(rows, stats)


def _next_kept(keep: np.ndarray) -> np.ndarray:
    """For each index ``i`` in ``[0, n]``, the first kept example at or after it (n: none)."""
    n = len(keep)
    marks = np.where(keep, np.arange(n), n)
    return np.concatenate([np.minimum.accumulate(marks[::-1])[::-1], [n]]).astype(np.int64)


def _orbit(step: np.ndarray, start: int, *, bound: int) -> np.ndarray:
    """``start, step[start], step[step[start]], ...`` below ``n = len(step) - 1`` (``step``
    is increasing to the absorbing ``n``), by binary lifting: ``log2(bound)`` whole-array
    gathers instead of one Python iteration per row."""
    n = len(step) - 1
    t = np.arange(max(bound, 1), dtype=np.int64)
    x = np.full(len(t), start, dtype=np.int64)
    jump, k = step.copy(), 0
    while (1 << k) < len(t):
        on = ((t >> k) & 1).astype(bool)
        x[on] = jump[x[on]]
        jump = jump[jump]
        k += 1
    return x[x < n]


def _rows(
    lengths: np.ndarray, answers: np.ndarray, *, length: int, packed: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(first example, end example, tokens, answer tokens) of each row, in order;
    examples without an answer token are left out, and a row never spans one (rows stay
    contiguous)."""
    capped = np.minimum(lengths, length)
    keep = answers > 0
    if not packed:
        first = np.flatnonzero(keep)
        return first, first + 1, capped[first], answers[first]
    n = len(lengths)
    prefix = np.concatenate([[0], np.cumsum(capped)])
    gained = np.concatenate([[0], np.cumsum(answers)])
    kept = _next_kept(keep)
    dropped = _next_kept(~keep)  # a row ends before the next dropped example
    ends = np.searchsorted(prefix, prefix[:-1] + length, side="right") - 1
    ends = np.maximum(np.minimum(ends, dropped[:-1]), np.arange(1, n + 1))
    step = np.concatenate([kept[ends], [n]])  # next row's first example
    first = _orbit(step, int(kept[0]), bound=int(keep.sum()))
    last = ends[first]
    return first, last, prefix[last] - prefix[first], gained[last] - gained[first]


def _window(
    mask: TokenStream,
    ends: DocEnds,
    answers: Callable[[int, int], np.ndarray],
    *,
    lo: int,
    hi: int,
    length: int,
    packed: bool,
) -> tuple[np.ndarray, PackStats, int]:
    """The final rows of examples ``[lo, hi)``, their stats, and where the next window
    starts ([Note: layout in windows])."""
    stops = ends.all(lo, hi)
    before = ends.all(lo - 1, lo) if lo else np.zeros(1, dtype=np.int64)
    starts = np.concatenate([before, stops[:-1]]).astype(np.int64)
    lengths = stops - starts
    gained = np.asarray(answers(lo, hi), dtype=np.int64).copy()
    long = np.flatnonzero(lengths > length)
    for i in long.tolist():  # a cut example keeps the answers of its first tokens only
        gained[i] = int(mask.read(int(starts[i]), int(starts[i]) + length).sum())
    first, last, size, targets = _rows(lengths, gained, length=length, packed=packed)
    done = hi - lo
    if packed and hi < len(ends) and len(first) and int(last[-1]) == done:
        done = int(first[-1])  # the last row may go on: lay it out with the next window
        first, size, targets = first[:-1], size[:-1], targets[:-1]
    rows = np.stack([starts[first], size, targets], axis=1).astype(np.int64)
    stats = PackStats(
        examples=int((gained[:done] > 0).sum()),
        rows=len(first),
        truncated=int((long < done).sum()),
        dropped=int((gained[:done] == 0).sum()),
        target_tokens=int(targets.sum()),
        tokens=int(size.sum()),
    )
    return rows, stats, lo + done


def _windows(
    mask: TokenStream,
    ends: DocEnds,
    answers: Callable[[int, int], np.ndarray],
    *,
    length: int,
    packed: bool,
    window: int,
) -> Iterator[tuple[np.ndarray, PackStats]]:
    """The rows and stats of every window, in order ([Note: layout in windows])."""
    window, lo = max(window, length + 1), 0
    while lo < len(ends):
        hi = min(lo + window, len(ends))
        rows, stats, lo = _window(mask, ends, answers, lo=lo, hi=hi, length=length, packed=packed)
        yield rows, stats


def build_layout(
    mask: TokenStream,
    ends: DocEnds,
    answers: Callable[[int, int], np.ndarray],
    *,
    length: int,
    packed: bool,
    out: Path | None = None,
    window: int = WINDOW,
) -> Layout:
    """The rows of the examples ending at ``ends`` ([Note: packing without
    cross-attention], [Note: layout in windows]); ``answers(lo, hi)`` gives the answer
    tokens of examples ``[lo, hi)``. With ``out`` the rows are written there as they are
    made (renamed into place when whole) and the result maps them; an ``OSError``
    writing it propagates, leaving nothing behind."""
    windows = _windows(mask, ends, answers, length=length, packed=packed, window=window)
    stats = NO_ROWS
    if out is None:
        parts = []
        for rows, more in windows:
            parts.append(rows)
            stats = stats.plus(more)
        table = np.concatenate(parts) if parts else np.empty((0, ROW_FIELDS), dtype=np.int64)
        return Layout(table, stats)
    tmp = out.with_name(f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}")
    meta = tmp.with_suffix(".json")
    try:
        with tmp.open("wb") as f:
            for rows, more in windows:
                f.write(rows.tobytes())
                stats = stats.plus(more)
        os.replace(tmp, out)
        meta.write_text(json.dumps(dataclasses.asdict(stats)))
        os.replace(meta, out.with_suffix(".json"))
    finally:
        tmp.unlink(missing_ok=True)
        meta.unlink(missing_ok=True)
    saved = Layout.load(out)
    if saved is None:
        raise OSError(f"the layout written to {out} does not read back")
    return saved
