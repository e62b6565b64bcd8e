"""Text in memory, through the same reading and tokenizing as a prepared dataset.

The built-in corpus is the Python standard library's own ``*.py`` sources: every
machine that runs fsdpkit has them, so the default run needs no download. Files are
read in sorted path order, so the stream is identical on every rank and every run (for
one Python version).

Training never uses these functions (it maps a prepared dataset, fsdpkit.data.pipeline);
they serve small tools, benchmarks and tests that want the whole stream as one tensor:
``load_token_stream`` prepares into a temporary directory and reads the shards back, so
its tokens are exactly a training run's.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import torch

from fsdpkit.config import DataConfig
from fsdpkit.data.dataset import PreparedDataset
from fsdpkit.data.errors import DataError
from fsdpkit.data.plan import describe_source, plan_units, resolve_config, stdlib_dir, stdlib_files
from fsdpkit.data.prepare import prepare
from fsdpkit.data.tokenizer import BulkEncoder, Tokenizer, document_ids
from fsdpkit.data.work import Job, texts_of

__all__ = ["describe_source", "load_token_stream", "read_documents", "stdlib_dir", "stdlib_files"]


def load_token_stream(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> torch.Tensor:
    """The whole (plain-text) corpus as one 1-D int64 tensor: every document followed by
    the separator, exactly as a prepared dataset stores it. ``tokenizer``: the one
    ``build_tokenizer(cfg)`` gives, or a user's own without a batch path (then encoded
    token by token in the same layout)."""
    if tokenizer is not None and not isinstance(tokenizer, BulkEncoder):
        return _slow(cfg, tokenizer)
    source = getattr(tokenizer, "source", None)
    if source is not None and not cfg.tokenizer:
        cfg = dataclasses.replace(cfg, tokenizer=str(source))
    with tempfile.TemporaryDirectory(prefix="fsdpkit-stream-") as tmp:
        done = prepare(cfg, Path(tmp) / "data", progress=False)
        if done.manifest.sft:
            raise DataError(f"{describe_source(cfg)} holds SFT rows, not plain text.")
        stream = PreparedDataset(done.path).tokens
        return torch.from_numpy(stream.read(0, len(stream)))


def _slow(cfg: DataConfig, tokenizer: Tokenizer) -> torch.Tensor:
    """A tokenizer of the user's own (no batch path): token by token, same layout."""
    docs = [np.asarray(tokenizer.encode(doc), dtype=np.int64) for doc in read_documents(cfg)]
    ids = [document_ids(tokenizer, doc) for doc in docs]
    if not sum(map(len, ids)):
        raise DataError(f"{describe_source(cfg)} holds no text: nothing to train on.")
    return torch.from_numpy(np.concatenate(ids))


def read_documents(cfg: DataConfig) -> list[str]:
    """The non-empty documents of the configured source (within ``data.max_bytes``)."""
    plan = plan_units(resolve_config(cfg), max_bytes=cfg.max_bytes)
    docs: list[str] = []
    current: list[str] = []
    for unit in plan.units:
        job = Job(plan.sources, unit, "", "", "text", "int64", cfg)
        for text, end in texts_of(job):
            current.append(text)
            if end:
                docs.append("".join(current))
                current = []
    return [d for d in docs if d]
