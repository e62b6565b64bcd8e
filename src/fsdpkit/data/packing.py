"""SFT examples -> fixed-length rows: packed several per row, or one per row.

A row holds ``seq_len + 1`` tokens (inputs are the first ``seq_len``, targets the last
``seq_len``, as for plain text). An example longer than that is cut to it and counted
(``truncated``); one left without a single answer token after the cut is dropped and
counted (``dropped``): it would teach nothing.

[Note: packing without cross-attention]
With ``data.pack = true`` examples are laid end to end in file order; an example that
does not fit in what is left of a row starts the next one, and the rest of the row is
padding (never a target). Position ids restart at 0 at each example (and at the
padding), and both the built-in Llama and transformers 5 turn such resets into a
block-diagonal causal mask: a token attends only to earlier tokens of its own example,
exactly as if the example were alone in its row (tests/unit/test_sft_data.py
checks per-example losses packed vs unpacked). The first token of each example is not a
target, so nothing is predicted across a boundary. With ``data.pack = false`` each
example gets a row of its own, padded.

Examples are stored back to back (a prepared dataset's shards), so every row is one
contiguous token range: the layout is two integers and an answer count per row (the
only per-row memory; plain text needs none), and ``take`` reads its rows' tokens and
masks from the memory-mapped shards.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fsdpkit.data.batch import IGNORE_INDEX, SFTBatch
from fsdpkit.data.errors import DataError
from fsdpkit.data.sft import Example
from fsdpkit.data.stream import DocEnds, TokenStream


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


def _layout(
    lengths: np.ndarray, answers: np.ndarray, *, length: int, packed: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first example, tokens, answer tokens) of each row, in order; examples without an
    answer token are left out, and a row never spans one (rows stay contiguous)."""
    capped = np.minimum(lengths, length)
    keep = answers > 0
    if not packed:
        first = np.flatnonzero(keep)
        return first, capped[first].astype(np.int32), answers[first].astype(np.int32)
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
    return (
        first,
        (prefix[last] - prefix[first]).astype(np.int32),
        (gained[last] - gained[first]).astype(np.int32),
    )


@dataclass(frozen=True)
class Layout:
    """Where each row starts in the stream, its tokens and its answer tokens."""

    rows: np.ndarray
    """(rows, 3) int64: start offset, tokens, answer tokens (in memory or mapped)."""
    stats: PackStats

    def save(self, path: Path) -> None:
        """``path`` (.npy) and its stats beside it, each renamed into place when whole."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
        with tmp.open("wb") as f:
            np.save(f, np.ascontiguousarray(self.rows, dtype=np.int64))
        os.replace(tmp, path)
        stats = tmp.with_suffix(".json")
        stats.write_text(json.dumps(dataclasses.asdict(self.stats)))
        os.replace(stats, path.with_suffix(".json"))

    @classmethod
    def load(cls, path: Path) -> Layout | None:
        """A saved layout, mapped (None when there is none or it is unreadable)."""
        try:
            stats = PackStats(**json.loads(path.with_suffix(".json").read_text()))
            rows = np.load(path, mmap_mode="r")
        except (OSError, ValueError, TypeError):
            return None
        return cls(rows, stats) if rows.shape == (stats.rows, 3) else None


def build_layout(
    mask: TokenStream, ends: DocEnds, answers: np.ndarray, *, length: int, packed: bool
) -> Layout:
    """The rows of the examples ending at ``ends`` ([Note: packing without
    cross-attention]); the only pass over every example, with whole-array operations."""
    stops = ends.all(0, len(ends))
    starts = np.concatenate([[0], stops[:-1]]).astype(np.int64)
    lengths = stops - starts
    gained = np.asarray(answers, dtype=np.int64).copy()
    long = np.flatnonzero(lengths > length)
    for i in long.tolist():  # a cut example keeps the answers of its first tokens only
        gained[i] = int(mask.read(int(starts[i]), int(starts[i]) + length).sum())
    first, size, targets = _layout(lengths, gained, length=length, packed=packed)
    stats = PackStats(
        examples=int((gained > 0).sum()),
        rows=len(first),
        truncated=len(long),
        dropped=int((gained == 0).sum()),
        target_tokens=int(targets.sum()),
        tokens=int(size.sum()),
    )
    return Layout(np.stack([starts[first], size, targets], axis=1).astype(np.int64), stats)


class PackedRows:
    """The rows of SFT examples stored back to back in ``tokens`` / ``mask`` (one
    stream each), example boundaries at ``ends`` ([Note: packing without
    cross-attention]). The layout is three integers per row, in memory or mapped from
    the run's cache; everything else is mapped from the shards."""

    def __init__(
        self,
        tokens: TokenStream,
        mask: TokenStream,
        ends: DocEnds,
        *,
        layout: Layout,
        seq_len: int,
        pad_id: int,
        packed: bool,
    ) -> None:
        self.tokens, self.mask, self.pad_id, self.packed = tokens, mask, pad_id, packed
        self.length = seq_len + 1
        self._ends = ends
        self._start, self._size, self._targets = (layout.rows[:, k] for k in range(3))
        self.stats = layout.stats

    def __len__(self) -> int:
        return len(self._start)

    def targets_in(self, index: np.ndarray | torch.Tensor) -> int:
        """Answer tokens (loss targets) in the rows ``index``."""
        return int(self._targets[np.asarray(index, dtype=np.int64)].sum())

    def _row(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo, n = int(self._start[r]), int(self._size[r])
        tokens = np.full(self.length, self.pad_id, dtype=np.int64)
        train = np.zeros(self.length, dtype=bool)
        tokens[:n] = self.tokens.read(lo, lo + n)
        train[:n] = self.mask.read(lo, lo + n) != 0
        positions = np.zeros(self.length, dtype=np.int64)
        cuts = [lo, *self._ends.between(lo, lo + n)]
        cuts += [lo + n] if cuts[-1] != lo + n else []
        for a, b in itertools.pairwise(cuts):
            positions[a - lo : b - lo] = np.arange(b - a)
        positions[n:] = np.arange(self.length - n)  # padding: a segment of its own
        return tokens, train, positions

    def take(
        self, index: np.ndarray | torch.Tensor, *, normalizer: float | None = None
    ) -> SFTBatch:
        """The rows ``index`` as a micro-batch (``normalizer``: see ``SFTBatch``)."""
        rows = [self._row(int(r)) for r in np.asarray(index, dtype=np.int64)]
        tokens = torch.from_numpy(np.stack([t for t, _, _ in rows]))
        train = torch.from_numpy(np.stack([m for _, m, _ in rows]))
        targets = torch.where(train[:, 1:], tokens[:, 1:], IGNORE_INDEX)
        positions = None
        if self.packed:
            positions = torch.from_numpy(np.stack([p for _, _, p in rows]))[:, :-1]
        return SFTBatch(
            inputs=tokens[:, :-1], targets=targets, positions=positions, normalizer=normalizer
        )

    def too_small(self, *, world: int, batch: int) -> DataError:
        return DataError(
            f"the SFT data packs into {len(self)} rows of data.seq_len {self.length - 1}, fewer "
            f"than one step needs ({world} rank(s) x train.micro_batch_size x "
            f"accumulation = {batch} per rank). Add examples, or lower train.micro_batch_size, "
            "the world size or data.val_fraction."
        )


Rows = PackedRows
"""The table of SFT rows (the name of the in-memory table before prepared datasets)."""


def pack(
    examples: Sequence[Example], *, seq_len: int, pad_id: int, packed: bool
) -> tuple[PackedRows, PackStats]:
    """Rows of ``seq_len + 1`` tokens of in-memory examples (tests, small tools)."""
    ids = [np.asarray(ex.ids, dtype=np.int64) for ex in examples]
    masks = [np.asarray(ex.train, dtype=np.uint8) for ex in examples]
    ends = DocEnds([np.cumsum([len(x) for x in ids], dtype=np.int64)], [0])
    answers = np.asarray([int(m.sum()) for m in masks], dtype=np.int64)
    empty = np.empty(0, dtype=np.int64)
    tokens = TokenStream([np.concatenate(ids) if ids else empty])
    mask = TokenStream([np.concatenate(masks) if masks else empty.astype(np.uint8)])
    layout = build_layout(mask, ends, answers, length=seq_len + 1, packed=packed)
    rows = PackedRows(
        tokens, mask, ends, layout=layout, seq_len=seq_len, pad_id=pad_id, packed=packed
    )
    return rows, rows.stats
