"""Per-rank SFT micro-batches with the plain-text loader's order and data position.

``SFTLoader`` is a ``PackedLoader`` whose sequences are the packed SFT rows
(fsdpkit.data.packing) instead of windows of one token stream, so it keeps every
guarantee of [Note: equal batches on every rank] and [Note: Data position maps
sensibly]: the same number of micro-batches on every rank, a fresh permutation of the
rows per epoch from (seed, epoch), and a position (epoch, global rows consumed) that
is independent of the world size. The validation split is the last
``data.val_fraction`` of the examples (in file order), packed on their own.

[Note: SFT loss weighting]
Rows hold different numbers of answer tokens, so a per-micro-batch mean would weigh a
token by how the global batch happens to be split over ranks: resuming at another
world size (same global batch) would change the loss. Each ``SFTBatch`` therefore
carries a ``normalizer``: the answer tokens of the whole optimizer step (all ranks'
rows of all its micro-batches, known to every rank since each holds the permutation)
divided by ranks x micro-batches. The loss is the sum of this rank's token losses over
it; the training step's division by the micro-batch count and FSDP's gradient average
over ranks then give the gradient of the mean over every answer token of the step,
however the global batch is split into ranks and micro-batches (train.global_batch_size
keeps the step's rows the same at any world size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fsdpkit.config import DataConfig
from fsdpkit.data.batch import SFTBatch
from fsdpkit.data.errors import DataError
from fsdpkit.data.loader import PackedLoader, validation_ids
from fsdpkit.data.packing import PackStats, Rows, pack
from fsdpkit.data.sft import ReadStats, load_examples
from fsdpkit.data.tokenizer import Tokenizer


class SFTLoader(PackedLoader):
    """Infinite per-rank iterator of ``SFTBatch`` micro-batches over ``rows``."""

    def __init__(self, rows: Rows, *, seq_len: int, micro_batch_size: int, **kwargs: Any) -> None:
        self._table = rows
        world = kwargs["dp_world"]
        if len(rows) < world * micro_batch_size:
            raise DataError(
                f"the SFT data packs into {len(rows)} rows of data.seq_len {seq_len}, fewer "
                f"than one step needs ({world} rank(s) x train.micro_batch_size "
                f"{micro_batch_size}). Add examples, or lower train.micro_batch_size, the "
                "world size or data.val_fraction."
            )
        # The base class counts sequences of a token stream; this one is never read
        # (``_rows`` is overridden): an expanded view of the right length, no memory.
        stream = torch.zeros(1, dtype=torch.int64).expand(len(rows) * seq_len + 1)
        super().__init__(stream, seq_len=seq_len, micro_batch_size=micro_batch_size, **kwargs)

    def _rows(self, seq_ids: torch.Tensor) -> SFTBatch:
        # The base class hands out perm[consumed + rank * B ...] and counts ``consumed``
        # up afterwards; this step began ``_micro`` micro-steps before ``consumed``.
        start = self._consumed - self._micro * self._micro_global
        step = self._permutation(self._epoch)[start : start + self._step_seqs]
        normalizer = self._table.targets_in(step) / (self._world * self._accum)
        return self._table.take(seq_ids, normalizer=normalizer)


@dataclass(frozen=True)
class SFTData:
    """The SFT source of a run: train rows, validation rows, and what was done."""

    train: Rows
    val: Rows | None
    read: ReadStats
    packing: PackStats

    def describe(self, cfg: DataConfig) -> str:
        kinds = f"{self.read.prompt_completion} prompt/completion, {self.read.chat} chat"
        packing = self.packing.describe(seq_len=cfg.seq_len, packed=cfg.pack)
        text = f"SFT data ({kinds} rows): {packing}"
        if self.val is not None:
            text += f"; {len(self.val)} validation rows"
        if self.read.stopped_at_max_bytes:
            text += (
                f"; reading stopped at data.max_bytes = {cfg.max_bytes} (raise it to use all rows)"
            )
        return text


def load_sft(cfg: DataConfig, tokenizer: Tokenizer) -> SFTData:
    """Read, check, tokenize and pack ``data.path`` (every rank does the same work)."""
    examples, read = load_examples(cfg, tokenizer)
    n_val = int(len(examples) * cfg.val_fraction)
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    train, stats = pack(
        examples[: len(examples) - n_val], seq_len=cfg.seq_len, pad_id=pad, packed=cfg.pack
    )
    val = None
    if n_val:
        held_out = examples[len(examples) - n_val :]
        val = pack(held_out, seq_len=cfg.seq_len, pad_id=pad, packed=cfg.pack)[0]
    return SFTData(train=train, val=val, read=read, packing=stats)


def sft_validation_batches(
    rows: Rows | None, *, micro_batch_size: int, dp_rank: int, dp_world: int, max_batches: int
) -> list[SFTBatch]:
    """This rank's validation micro-batches (the order of ``validation_batches``)."""
    if rows is None:
        return []
    ids = validation_ids(
        len(rows),
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_world=dp_world,
        max_batches=max_batches,
    )
    step = dp_world * micro_batch_size
    out = []
    for seq_ids in ids:
        first = int(seq_ids[0]) - dp_rank * micro_batch_size
        total = rows.targets_in(torch.arange(first, first + step))
        out.append(rows.take(seq_ids, normalizer=total / dp_world))
    return out
