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
contiguous token range: the layout (fsdpkit.data.layout) is two integers and an answer
count per row, mapped from the run's cache (plain text needs none), and ``take`` reads
its rows' tokens and masks from the memory-mapped shards.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from fsdpkit.data.batch import IGNORE_INDEX, SFTBatch
from fsdpkit.data.errors import DataError
from fsdpkit.data.layout import Layout, PackStats, build_layout
from fsdpkit.data.sft import Example
from fsdpkit.data.stream import DocEnds, TokenStream


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
        """Too few rows for one step, and why: on every rank the same paragraph, from
        the layout's stats, so the rank the launcher reports names the cause too."""
        seq_len = self.length - 1
        text = (
            f"the SFT data packs into {len(self)} rows of data.seq_len {seq_len}, fewer than "
            f"one step needs ({world} rank(s) x train.micro_batch_size x accumulation = "
            f"{batch} per rank)"
        )
        text += self._unpacked(world=world, batch=batch)
        lost = self.stats.dropped + self.stats.truncated
        if not lost:
            return DataError(
                f"{text}. Add examples, or lower train.micro_batch_size, the world size or "
                "data.val_fraction."
            )
        return DataError(
            f"{text}: {_cut(self.stats, length=self.length)} The longest example has "
            f"{self._longest():,} tokens: raise data.seq_len (to {self._longest() - 1:,} to keep "
            "every example whole), or add examples, or lower train.micro_batch_size, the "
            "world size or data.val_fraction."
        )

    def _unpacked(self, *, world: int, batch: int) -> str:
        """What ``data.pack = false`` would give when it fills a step (a small dataset
        packs into fewer rows than there are examples), else ''."""
        n = self.stats.examples
        if not self.packed or n <= len(self) or n < world:
            return ""
        text = f". With data.pack=false each of the {n:,} examples gets a row of its own"
        if n >= world * batch:
            return f"{text}, enough for a step: set data.pack=false"
        fit = world * (n // world)
        return (
            f"{text}, enough for a step of {fit:,} rows: set data.pack=false and "
            f"train.global_batch_size={fit}"
        )

    def _longest(self) -> int:
        """Tokens of the longest example (read from the example ends, at error time)."""
        stops = self._ends.all(0, len(self._ends))
        return int(np.diff(stops, prepend=0).max()) if len(stops) else 0


def _cut(stats: PackStats, *, length: int) -> str:
    """What cutting examples to ``length`` tokens did, as a sentence."""
    total = stats.examples + stats.dropped
    text = f"of {total:,} example(s), {stats.truncated:,} are longer than data.seq_len + 1 = "
    text += f"{length} tokens and were cut to it"
    if stats.dropped:
        text += (
            f"; {stats.dropped:,} were then dropped: their prompt fills the row, so no "
            "answer token is left to train on"
        )
    return text + "."


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
    layout = build_layout(
        mask, ends, lambda lo, hi: answers[lo:hi], length=seq_len + 1, packed=packed
    )
    rows = PackedRows(
        tokens, mask, ends, layout=layout, seq_len=seq_len, pad_id=pad_id, packed=packed
    )
    return rows, rows.stats
