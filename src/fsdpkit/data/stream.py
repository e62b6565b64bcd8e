"""A 1-D token sequence stored in parts: memory-mapped shard files, or arrays in memory.

A prepared dataset's tokens are the concatenation of its shards' token files. Reading a
window maps only the pages it touches, so a rank that trains on a few thousand
sequences reads a few thousand sequences' bytes, however large the corpus; nothing in
here is per token or per sequence (the parts' end offsets are one integer per shard).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fsdpkit.data.errors import DataError


def map_array(path: Path, *, dtype: str | np.dtype, count: int) -> np.ndarray:
    """``count`` items of ``dtype`` from ``path``, memory-mapped read-only (empty: no map)."""
    if count == 0:
        return np.empty(0, dtype=dtype)
    try:
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,))
    except (OSError, ValueError) as exc:
        raise DataError(
            f"cannot map {path} ({exc}); the prepared dataset is damaged. Run `fsdpkit data "
            "inspect` on it, and prepare it again."
        ) from exc


class TokenStream:
    """Read-only view of the concatenation of ``parts`` between ``start`` and ``stop``."""

    def __init__(self, parts: Sequence[np.ndarray], *, start: int = 0, stop: int | None = None):
        self._parts = list(parts)
        self._ends = np.cumsum([len(p) for p in self._parts], dtype=np.int64)
        total = int(self._ends[-1]) if len(self._ends) else 0
        self.start = start
        self.stop = total if stop is None else stop
        if not 0 <= self.start <= self.stop <= total:
            raise ValueError(f"range [{start}, {stop}) outside a stream of {total} tokens")

    def __len__(self) -> int:
        return self.stop - self.start

    def view(self, start: int, stop: int) -> TokenStream:
        """Tokens ``[start, stop)`` of this view (no copy)."""
        out = TokenStream.__new__(TokenStream)
        out._parts, out._ends = self._parts, self._ends
        out.start, out.stop = self.start + start, self.start + stop
        if not self.start <= out.start <= out.stop <= self.stop:
            raise ValueError(f"range [{start}, {stop}) outside a view of {len(self)} tokens")
        return out

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of this view as a new int64 array."""
        lo, hi = self.start + start, self.start + stop
        if not self.start <= lo <= hi <= self.stop:
            raise IndexError(f"range [{start}, {stop}) outside a view of {len(self)} tokens")
        out = np.empty(hi - lo, dtype=np.int64)
        part = int(np.searchsorted(self._ends, lo, side="right"))
        at = 0
        while lo < hi:
            base = int(self._ends[part - 1]) if part else 0
            take = min(hi, int(self._ends[part])) - lo
            out[at : at + take] = self._parts[part][lo - base : lo - base + take]
            at, lo, part = at + take, lo + take, part + 1
        return out

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows ``[s, s + length)`` for each start: an int64 array (len(starts), length)."""
        rows = np.empty((len(starts), length), dtype=np.int64)
        for i, s in enumerate(np.asarray(starts, dtype=np.int64).tolist()):
            rows[i] = self.read(s, s + length)
        return rows


class DocEnds:
    """Document end offsets of a stream stored per part (each part's ends local to it),
    read through maps: the ends inside a token range cost a binary search, and nothing
    per document is held in memory."""

    def __init__(self, parts: Sequence[np.ndarray], offsets: Any, *, start: int = 0) -> None:
        self.parts = list(parts)
        self.offsets = [int(o) for o in offsets]
        self._parts = self.parts
        self._offsets = np.asarray(self.offsets, dtype=np.int64)
        self._counts = np.cumsum([0] + [len(p) for p in self._parts], dtype=np.int64)
        self.start = start

    def __len__(self) -> int:
        return int(self._counts[-1])

    def view(self, start: int) -> DocEnds:
        """The same ends measured from token ``start`` of this view."""
        return DocEnds(self._parts, self._offsets, start=self.start + start)

    def all(self, first: int, stop: int) -> np.ndarray:
        """Ends of documents ``[first, stop)`` in view coordinates (a temporary array)."""
        out = []
        for part, offset, lo in zip(self._parts, self._offsets, self._counts[:-1]):
            a, b = max(first - int(lo), 0), min(stop - int(lo), len(part))
            if a < b:
                out.append(np.asarray(part[a:b], dtype=np.int64) + (int(offset) - self.start))
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def between(self, lo: int, hi: int) -> list[int]:
        """Ends strictly after ``lo`` and at or before ``hi`` (view coordinates)."""
        glo, ghi = lo + self.start, hi + self.start
        out: list[int] = []
        part = max(int(np.searchsorted(self._offsets, glo, side="right")) - 1, 0)
        while part < len(self._parts) and int(self._offsets[part]) <= ghi:
            local = self._parts[part]
            base = int(self._offsets[part])
            a, b = np.searchsorted(local, [glo - base, ghi - base], side="right")
            out += [int(e) + base - self.start for e in local[a:b]]
            part += 1
        return out
