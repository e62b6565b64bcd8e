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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fsdpkit.data.batch import IGNORE_INDEX, SFTBatch
from fsdpkit.data.sft import Example


@dataclass(frozen=True)
class Rows:
    """A table of SFT rows (``seq_len + 1`` tokens each)."""

    tokens: torch.Tensor
    """(rows, seq_len + 1) int64."""
    train: torch.Tensor
    """(rows, seq_len + 1) bool: the token is a target."""
    positions: torch.Tensor | None
    """(rows, seq_len + 1) int64 position ids; None when unpacked."""

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def targets_in(self, index: torch.Tensor) -> int:
        """Answer tokens (loss targets) in the rows ``index``."""
        return int(self.train[index][:, 1:].sum())

    def take(self, index: torch.Tensor, *, normalizer: float | None = None) -> SFTBatch:
        """The rows ``index`` as a micro-batch (``normalizer``: see ``SFTBatch``)."""
        tokens, train = self.tokens[index], self.train[index]
        targets = torch.where(train[:, 1:], tokens[:, 1:], IGNORE_INDEX)
        positions = None if self.positions is None else self.positions[index][:, :-1]
        return SFTBatch(
            inputs=tokens[:, :-1], targets=targets, positions=positions, normalizer=normalizer
        )


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
            f"{self.examples} examples {how} {self.rows} rows of {seq_len} (tokens "
            f"{fill:.0f}% of the rows, {self.target_tokens} answer tokens)"
        )
        if self.truncated:
            text += (
                f"; {self.truncated} example(s) longer than data.seq_len + 1 = {seq_len + 1} "
                "tokens truncated"
            )
        if self.dropped:
            text += f"; {self.dropped} dropped (no answer token left after truncation)"
        return text


def _fit(examples: Sequence[Example], length: int) -> tuple[list[Example], int, int]:
    """Examples cut to ``length`` tokens; (kept, truncated, dropped)."""
    kept, truncated, dropped = [], 0, 0
    for ex in examples:
        if len(ex.ids) > length:
            truncated += 1
            ex = Example(ids=ex.ids[:length], train=ex.train[:length])
        if ex.train.any():
            kept.append(ex)
        else:
            dropped += 1
    return kept, truncated, dropped


def _layout(examples: list[Example], length: int, *, packed: bool) -> list[list[Example]]:
    """Which examples share each row, in order."""
    rows: list[list[Example]] = []
    used = length
    for ex in examples:
        if not packed or used + len(ex.ids) > length:
            rows.append([])
            used = 0
        rows[-1].append(ex)
        used += len(ex.ids)
    return rows


def pack(
    examples: Sequence[Example], *, seq_len: int, pad_id: int, packed: bool
) -> tuple[Rows, PackStats]:
    """Rows of ``seq_len + 1`` tokens ([Note: packing without cross-attention])."""
    length = seq_len + 1
    kept, truncated, dropped = _fit(examples, length)
    layout = _layout(kept, length, packed=packed)
    tokens = np.full((len(layout), length), pad_id, dtype=np.int64)
    train = np.zeros((len(layout), length), dtype=bool)
    positions = np.zeros((len(layout), length), dtype=np.int64)
    for r, members in enumerate(layout):
        at = 0
        for ex in members:
            n = len(ex.ids)
            tokens[r, at : at + n] = ex.ids
            train[r, at : at + n] = ex.train
            positions[r, at : at + n] = np.arange(n)
            at += n
        positions[r, at:] = np.arange(length - at)  # padding: a segment of its own
    stats = PackStats(
        examples=len(kept),
        rows=len(layout),
        truncated=truncated,
        dropped=dropped,
        target_tokens=int(train[:, 1:].sum()),
        tokens=sum(len(ex.ids) for ex in kept),
    )
    rows = Rows(
        tokens=torch.from_numpy(tokens),
        train=torch.from_numpy(train),
        positions=torch.from_numpy(positions) if packed else None,
    )
    return rows, stats
