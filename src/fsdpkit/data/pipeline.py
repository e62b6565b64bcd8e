"""The trainer's one entry point into the data package: ``open_training_data``.

    data = open_training_data(cfg.data, seed=cfg.train.seed, micro_batch=split.micro_batch,
                              grad_accum=split.grad_accum, dp_rank=rank, dp_world=world,
                              eval_batches=cfg.train.eval_batches, work_dir=run_dir,
                              steps=cfg.train.steps)
    batches = data.loader.next_step()       # this rank's micro-batches of one step
    print(data.note)                        # what the run trains on

There is one pipeline: ``data.path`` naming a dataset written by ``fsdpkit data
prepare`` is mapped as it is; raw sources (or the built-in corpus) are first prepared
into the run's cache, once per node (fsdpkit.data.cache), then mapped the same way
(fsdpkit.data.opened); ``data.mix`` does that per source (fsdpkit.data.mix). It is
called on every rank before the process group exists, so it uses no collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpkit.config import DataConfig
from fsdpkit.data.first_lines import describe_run
from fsdpkit.data.loader import Loader, validation_from
from fsdpkit.data.mix import open_mixture
from fsdpkit.data.opened import open_source
from fsdpkit.data.tokenizer import Tokenizer


@dataclass
class TrainingData:
    """Everything a training run needs from its data."""

    tokenizer: Tokenizer
    loader: Any
    """``next_step()`` -> this rank's micro-batches of one optimizer step, ``next_batch()``,
    ``state_dict()`` / ``load_state_dict()`` (world-size independent), ``steps_per_epoch``,
    ``num_sequences``."""
    val: list[Any]
    """This rank's validation micro-batches (token tensors, or SFTBatch)."""
    sft: bool
    """Loss on answer tokens only (SFTBatch micro-batches)."""
    note: str | None
    """What the run prints first: what it trains on (sources, schema, documents,
    tokens, sequences and steps per epoch, epochs of this run, what was left out)."""
    datasets: list[Path] = field(default_factory=list)
    """The prepared dataset directories the run maps."""
    record: dict[str, Any] = field(default_factory=dict)
    """The note as data, for metrics.jsonl's ``{"step", "data"}`` record: datasets, SFT
    or text, training sequences, steps per epoch and, for ``data.mix``, each source's
    weight and share of the sequences."""

    def epochs(self, steps: int) -> float:
        """Epochs ``steps`` optimizer steps cover."""
        return steps / max(self.loader.steps_per_epoch, 1)


def open_training_data(
    cfg: DataConfig,
    *,
    seed: int,
    micro_batch: int,
    grad_accum: int,
    dp_rank: int,
    dp_world: int,
    eval_batches: int,
    work_dir: Path,
    steps: int | None = None,
) -> TrainingData:
    """This rank's view of the configured data: tokenizer, loader, validation batches
    (``steps``: the run's optimizer steps, for the epochs line of the note)."""
    ranks: dict[str, Any] = {"dp_rank": dp_rank, "dp_world": dp_world}
    batch: dict[str, Any] = {
        "micro_batch_size": micro_batch,
        "seed": seed,
        "grad_accum": grad_accum,
    }
    if cfg.mix:
        mixed = open_mixture(cfg, work_dir=work_dir, **ranks, **batch)
        val = mixed.validation(micro_batch_size=micro_batch, max_batches=eval_batches, **ranks)
        data = TrainingData(mixed.tokenizer, mixed.loader, val, mixed.sft, None, mixed.roots)
        data.note = mixed.describe(steps=steps, epochs=data.epochs)
        data.record = _record(data) | {"mix": mixed.shares}
        return data
    opened, tokenizer = open_source(cfg, work_dir=work_dir)
    loader = Loader(opened.train, weighted=opened.sft, **batch, **ranks)
    val = []
    if opened.val is not None:
        val = validation_from(
            opened.val,
            micro_batch_size=micro_batch,
            max_batches=eval_batches,
            weighted=opened.sft,
            **ranks,
        )
    data = TrainingData(tokenizer, loader, val, opened.sft, None, [opened.dataset.root])
    data.note = describe_run(
        opened, tokenizer=tokenizer, loader=loader, steps=steps, epochs=data.epochs
    )
    data.record = _record(data)
    return data


def _record(data: TrainingData) -> dict[str, Any]:
    return {
        "datasets": [str(p.resolve()) for p in data.datasets],
        "sft": data.sft,
        "train_sequences": int(data.loader.num_sequences),
        "steps_per_epoch": int(data.loader.steps_per_epoch),
    }
