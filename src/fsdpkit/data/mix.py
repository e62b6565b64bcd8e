"""``data.mix``: several datasets sampled by weight, deterministically, resumably.

[Note: mixtures]
Each source is prepared (or mapped) on its own, as ``data.path`` would be. Weights
become whole slot counts in a block of ``BLOCK`` sequences (largest remainder, every
source at least one slot), spread over the block by smooth weighted round-robin. The
mixture's global position ``p`` falls in block ``p // BLOCK`` at slot ``p % BLOCK``:
that slot's source and its count of earlier slots give the source's own position ``q``,
and the source's permutation of epoch ``q // n`` (its own epochs: a small source
repeats sooner) gives the sequence. Everything is a function of ``p``: the loader's
``{"epoch", "consumed"}`` position resumes the mixture exactly at any world size, and
each source's share of every block is exactly its slot count / ``BLOCK``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fsdpkit.config import DataConfig
from fsdpkit.data.batch import SFTBatch
from fsdpkit.data.errors import DataError
from fsdpkit.data.first_lines import epochs_line, source_line, special_tokens_line
from fsdpkit.data.loader import Loader, Sequences, validation_from
from fsdpkit.data.opened import Opened, open_source
from fsdpkit.data.order import Permutation
from fsdpkit.data.tokenizer import Tokenizer

BLOCK = 4096
"""Slots of one mixture block: shares are multiples of 1/BLOCK."""


def parse_mix(entries: list[str]) -> list[tuple[str, float]]:
    """``["wiki/@3", "code.jsonl"]`` -> [("wiki/", 3.0), ("code.jsonl", 1.0)]."""
    out = []
    for entry in entries:
        path, sep, weight = entry.rpartition("@")
        if not sep:
            path, weight = entry, "1"
        try:
            value = float(weight)
        except ValueError:
            path, value = entry, 1.0  # an '@' inside the path, no weight
        if not path or not value > 0 or value != value:
            raise DataError(
                f"data.mix entry {entry!r} must be 'PATH@WEIGHT' with a weight > 0 (or just "
                'PATH for weight 1), e.g. data.mix=["wiki/@3", "code.jsonl@1"].'
            )
        out.append((path, value))
    return out


def slot_counts(weights: list[float], *, block: int = BLOCK) -> list[int]:
    """Whole slots per source summing to ``block`` (largest remainder, each >= 1)."""
    total = sum(weights)
    exact = [w / total * block for w in weights]
    counts = [max(1, int(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    i = 0
    while sum(counts) < block:
        counts[order[i % len(order)]] += 1
        i += 1
    while sum(counts) > block:
        j = max(range(len(counts)), key=lambda k: counts[k])
        counts[j] -= 1
    return counts


def interleave(counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source of each slot, how many earlier slots that source has): smooth weighted
    round-robin, so every source's slots are spread evenly over the block."""
    block = sum(counts)
    current = [0] * len(counts)
    source = np.empty(block, dtype=np.int64)
    rank = np.empty(block, dtype=np.int64)
    seen = [0] * len(counts)
    for j in range(block):
        current = [c + n for c, n in zip(current, counts)]
        pick = max(range(len(counts)), key=lambda k: current[k])
        current[pick] -= block
        source[j], rank[j] = pick, seen[pick]
        seen[pick] += 1
    return source, rank


class Mixed:
    """A table whose ids are global mixture positions ([Note: mixtures])."""

    def __init__(self, tables: list[Sequences], counts: list[int], *, seed: int) -> None:
        self.tables, self.counts, self.seed = tables, counts, seed
        self._slot_source, self._slot_rank = interleave(counts)
        self._perms: dict[tuple[int, int], Permutation] = {}

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, sequence id within the source) of each global position."""
        ids = np.asarray(ids, dtype=np.int64)
        block, slot = ids // BLOCK, ids % BLOCK
        source = self._slot_source[slot]
        q = block * np.asarray(self.counts, dtype=np.int64)[source] + self._slot_rank[slot]
        seq = np.empty_like(ids)
        for i, (s, pos) in enumerate(zip(source.tolist(), q.tolist())):
            n = len(self.tables[s])
            key = (s, pos // n)
            if key not in self._perms:
                if len(self._perms) > 64:
                    self._perms.clear()
                self._perms[key] = Permutation(n, seed=self.seed + 7919 * s, epoch=pos // n)
            seq[i] = self._perms[key](np.asarray([pos % n]))[0]
        return source, seq

    def take(self, ids: np.ndarray, *, normalizer: float | None = None) -> Any:
        source, seq = self.locate(ids)
        parts = [
            self.tables[s].take(np.asarray([q]), normalizer=normalizer) for s, q in zip(source, seq)
        ]
        if isinstance(parts[0], SFTBatch):
            positions = (
                None if parts[0].positions is None else torch.cat([p.positions for p in parts])
            )
            return SFTBatch(
                inputs=torch.cat([p.inputs for p in parts]),
                targets=torch.cat([p.targets for p in parts]),
                positions=positions,
                normalizer=normalizer,
            )
        return torch.cat(parts)

    def targets_in(self, ids: np.ndarray) -> int:
        source, seq = self.locate(ids)
        return sum(self.tables[s].targets_in(np.asarray([q])) for s, q in zip(source, seq))

    def too_small(self, *, world: int, batch: int) -> DataError:
        return DataError(
            f"data.mix holds {len(self)} sequences in all, fewer than one step needs "
            f"({world} rank(s) x {batch}); add data or lower the batch."
        )


class MixLoader(Loader):
    """A ``Loader`` over a ``Mixed`` table: positions run on across epochs (every
    epoch is ``steps_per_epoch`` x ``G`` further along the mixture), no reshuffle on top
    of the sources' own permutations."""

    def _permutation(self, epoch: int) -> Any:
        span = self.steps_per_epoch * self.step_sequences

        def order(positions: np.ndarray) -> np.ndarray:
            return epoch * span + np.asarray(positions, dtype=np.int64)

        return order


@dataclass
class Mixture:
    tokenizer: Tokenizer
    loader: MixLoader
    sft: bool
    roots: list[Path]
    val_tables: list[Any]
    lines: list[str]
    shares: list[dict[str, Any]]
    """Per source: path, weight, share of the sequences, training sequences."""

    def validation(
        self, *, micro_batch_size: int, dp_rank: int, dp_world: int, max_batches: int
    ) -> list[Any]:
        """Each source's validation batches, an equal share of ``max_batches`` each."""
        tables = [t for t in self.val_tables if t is not None]
        share = max(1, max_batches // max(len(tables), 1)) if max_batches else 0
        out: list[Any] = []
        for table in tables:
            out += validation_from(
                table,
                micro_batch_size=micro_batch_size,
                dp_rank=dp_rank,
                dp_world=dp_world,
                max_batches=share,
                weighted=self.sft,
            )
        return out[:max_batches]

    def describe(self, *, steps: int | None, epochs: Any) -> str:
        text = "\n".join(self.lines)
        if steps:
            text += (
                f"\ndata.mix: this run's {steps:,} steps cover {epochs(steps):.2f} mixture epoch(s)"
            )
        return text


def open_mixture(cfg: DataConfig, *, work_dir: Path, **loader_args: Any) -> Mixture:
    """Open every ``data.mix`` source and the loader over their mixture."""
    entries = parse_mix(cfg.mix)
    opened: list[Opened] = []
    tokenizer = None
    for i, (path, _) in enumerate(entries):
        one = dataclasses.replace(cfg, path=path, mix=[])
        source, tokenizer = open_source(
            one, work_dir=work_dir, name=f"mix-{i}", tokenizer=tokenizer
        )
        opened.append(source)
    assert tokenizer is not None
    kinds = {o.sft for o in opened}
    if len(kinds) > 1:
        raise DataError(
            "data.mix mixes plain-text and SFT sources; their batches differ (every token "
            "vs answers only), so a mixture holds one kind. Train them in separate runs."
        )
    counts = slot_counts([w for _, w in entries])
    table = Mixed([o.train for o in opened], counts, seed=loader_args["seed"])
    sft = opened[0].sft
    loader = MixLoader(table, weighted=sft, **loader_args)
    lines = [source_line(o) for o in opened]
    lines += sorted({special_tokens_line(o, tokenizer) for o in opened})
    shares = [
        {"path": path, "weight": weight, "share": n / BLOCK, "train_sequences": len(o.train)}
        for (path, weight), o, n in zip(entries, opened, counts)
    ]
    for (path, weight), o, n in zip(entries, opened, counts):
        per_step = loader.step_sequences * n / BLOCK
        lines.append(
            f"data.mix: {path} weight {weight:g} -> {n / BLOCK:.2%} of sequences "
            f"({len(o.train):,} sequences: one pass every {len(o.train) / per_step:,.1f} steps)"
        )
    lines.append(epochs_line(loader, steps=None, epochs=lambda s: 0.0))
    roots = [o.dataset.root for o in opened]
    return Mixture(tokenizer, loader, sft, roots, [o.val for o in opened], lines, shares)
