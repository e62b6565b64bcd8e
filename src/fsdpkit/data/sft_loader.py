"""Per-rank SFT micro-batches with the plain-text loader's order and data position.

``SFTLoader`` is a ``Loader`` whose sequences are packed SFT rows
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
rows of all its micro-batches, known to every rank since each computes the
permutation) divided by ranks x micro-batches. The loss is the sum of this rank's token
losses over it; the training step's division by the micro-batch count and FSDP's
gradient average over ranks then give the gradient of the mean over every answer token
of the step, however the global batch is split into ranks and micro-batches
(train.global_batch_size keeps the step's rows the same at any world size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdpkit.config import DataConfig
from fsdpkit.data.batch import SFTBatch
from fsdpkit.data.loader import Loader, validation_from
from fsdpkit.data.packing import PackedRows, pack
from fsdpkit.data.sft import describe_schemas
from fsdpkit.data.tokenizer import Tokenizer
from fsdpkit.data.work import load_examples


class SFTLoader(Loader):
    """Infinite per-rank iterator of ``SFTBatch`` micro-batches over ``rows``."""

    def __init__(
        self, rows: PackedRows, *, seq_len: int, micro_batch_size: int, **kwargs: Any
    ) -> None:
        del seq_len  # the rows' own (kept for callers that pass it)
        super().__init__(rows, micro_batch_size=micro_batch_size, weighted=True, **kwargs)


def sft_validation_batches(
    rows: PackedRows | None, *, micro_batch_size: int, dp_rank: int, dp_world: int, max_batches: int
) -> list[SFTBatch]:
    """This rank's validation micro-batches (the order of ``validation_batches``)."""
    if rows is None:
        return []
    return validation_from(
        rows,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_world=dp_world,
        max_batches=max_batches,
        weighted=True,
    )


@dataclass(frozen=True)
class SFTData:
    """In-memory SFT rows (the trainer's path before ``open_training_data``; kept until
    it calls that)."""

    train: PackedRows
    val: PackedRows | None
    schemas: dict[str, int]

    def describe(self, cfg: DataConfig) -> str:
        text = f"SFT data ({describe_schemas(self.schemas)}): "
        text += self.train.stats.describe(seq_len=cfg.seq_len, packed=cfg.pack)
        return text + (f"; {len(self.val)} validation rows" if self.val is not None else "")


def load_sft(cfg: DataConfig, tokenizer: Tokenizer) -> SFTData:
    """Read, check, tokenize and pack ``data.path`` in memory (the last
    ``data.val_fraction`` of the examples held out)."""
    examples, schemas = load_examples(cfg, tokenizer)
    n_val = int(len(examples) * cfg.val_fraction)
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    shape = {"seq_len": cfg.seq_len, "pad_id": pad, "packed": cfg.pack}
    train, _ = pack(examples[: len(examples) - n_val], **shape)  # type: ignore[arg-type]
    val = pack(examples[len(examples) - n_val :], **shape)[0] if n_val else None  # type: ignore[arg-type]
    return SFTData(train=train, val=val, schemas=dict(schemas))
