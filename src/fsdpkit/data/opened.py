"""A dataset opened for a run: mapped (prepared first when raw), split, as tables.

``open_source`` is what ``data.path`` and each ``data.mix`` source go through: a
directory written by ``fsdpkit data prepare`` is mapped as it is, raw sources are
prepared into the cache first (fsdpkit.data.cache); then the tokenizer is checked
against the dataset's, the split is made by documents ([Note: validation by documents])
and the train and validation parts become sequence tables for the loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpkit.config import DataConfig
from fsdpkit.data.cache import cache_root, prepared
from fsdpkit.data.dataset import PreparedDataset, Split
from fsdpkit.data.errors import DataError
from fsdpkit.data.loader import Windows
from fsdpkit.data.manifest import is_dataset
from fsdpkit.data.prepare import Prepared
from fsdpkit.data.tokcheck import dataset_tokenizer, mismatch
from fsdpkit.data.tokenizer import Tokenizer


@dataclass
class Opened:
    """A dataset a run maps, how it got there, and its train / validation tables."""

    cfg: DataConfig
    dataset: PreparedDataset
    prepared: Prepared | None
    """None: data.path was a prepared dataset."""
    split: Split
    train: Any
    """``Windows`` (text) or ``PackedRows`` (SFT) of the training part."""
    val: Any
    """The same of the validation part, or None."""

    @property
    def sft(self) -> bool:
        return self.dataset.manifest.sft


def map_dataset(
    cfg: DataConfig, *, work_dir: Path, name: str
) -> tuple[PreparedDataset, Prepared | None]:
    """``cfg.path`` mapped: itself when prepared, else prepared into the cache first."""
    layouts = cache_root(cfg, work_dir) / "layouts"
    if cfg.path and is_dataset(Path(cfg.path).expanduser()):
        return PreparedDataset(Path(cfg.path).expanduser(), layout_dir=layouts), None
    result = prepared(cfg, work_dir=work_dir, name=name)
    return PreparedDataset(result.path, layout_dir=layouts), result


def open_source(
    cfg: DataConfig, *, work_dir: Path, name: str = "train", tokenizer: Tokenizer | None = None
) -> tuple[Opened, Tokenizer]:
    """One source as train / validation tables (``tokenizer``: the run's, when another
    source already fixed it; it must be this dataset's too)."""
    ds, result = map_dataset(cfg, work_dir=work_dir, name=name)
    if tokenizer is None:
        tokenizer = dataset_tokenizer(cfg, ds.manifest, root=ds.root)
    else:
        why = mismatch(
            ds.root,
            ds.manifest,
            given=tokenizer.fingerprint(),  # type: ignore[attr-defined]
            named="the first data.mix source's tokenizer",
        )
        if why:
            raise DataError(why)
    split = ds.split(cfg.val_fraction)
    if ds.manifest.sft:
        pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        shape: dict[str, Any] = {"seq_len": cfg.seq_len, "pad_id": pad, "packed": cfg.pack}
        train: Any = ds.sft_rows(first=0, stop=split.train_end, **shape)
        val: Any = (
            ds.sft_rows(first=split.train_end, stop=ds.documents, **shape)
            if split.val_docs
            else None
        )
    else:
        stream = ds.tokens
        train = Windows(stream.view(0, split.train_end), seq_len=cfg.seq_len)
        val = Windows(stream.view(split.train_end, len(stream)), seq_len=cfg.seq_len)
    return Opened(cfg, ds, result, split, train, val), tokenizer
