"""A prepared dataset opened for training: mapped shards, the train/validation split.

Opening maps every shard (no read) and checks file sizes against the manifest; a text
dataset then needs O(shards) memory. The split is by documents ([Note: validation by
documents]); SFT rows are laid out from the example lengths (fsdpkit.data.packing).

[Note: validation by documents]
The validation split is the last ``floor(documents * data.val_fraction)`` documents
(text) or examples (SFT) of the dataset, whole, in order: a document is never half in
training and half in validation, and the split is the same on every rank and run.
A text corpus with too few documents for that (a single big file) holds out its last
``val_fraction`` of tokens instead, and the run's first lines say so.

[Note: SFT layout cache]
The rows of an SFT split depend on ``data.seq_len`` and ``data.pack``, which a prepared
dataset does not know, so the first open of a run lays them out (window by window,
[Note: layout in windows]) into the run's data cache (``RUN_DIR/data/layouts``, or
``data.cache_dir``), keyed by the dataset, the split and those settings; every later
open (the other ranks, a resume, an evaluation) maps the file. Ranks that build it at
the same time write private files and rename them: the same bytes win either way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fsdpkit.data.layout import Layout, build_layout
from fsdpkit.data.manifest import Manifest, open_manifest
from fsdpkit.data.packing import PackedRows
from fsdpkit.data.stream import DocEnds, TokenStream, map_array


@dataclass(frozen=True)
class Split:
    """Where validation starts: a token offset (text) or an example index (SFT)."""

    train_end: int
    val_docs: int
    by_tokens: bool
    """The corpus had too few documents: the split is at a token offset."""


class PreparedDataset:
    """The shards of a prepared dataset, memory-mapped read-only."""

    def __init__(self, root: Path, *, layout_dir: Path | None = None) -> None:
        self.root = root
        self.layout_dir = layout_dir
        self.manifest: Manifest = open_manifest(root)
        m = self.manifest
        files = [s.files(root, sft=m.sft) for s in m.shards]
        self.tokens = TokenStream(
            [map_array(f["tokens"], dtype=m.dtype, count=s.tokens) for f, s in zip(files, m.shards)]
        )
        self.mask = None
        if m.sft:
            self.mask = TokenStream(
                [
                    map_array(f["mask"], dtype="uint8", count=s.tokens)
                    for f, s in zip(files, m.shards)
                ]
            )
        self._doc_files = [f["docs"] for f in files]
        self._answer_files = [f.get("answers") for f in files]
        self._doc_counts = np.cumsum([0] + [s.docs for s in m.shards], dtype=np.int64)
        self._tok_offsets = np.cumsum([0] + [s.tokens for s in m.shards], dtype=np.int64)

    @property
    def documents(self) -> int:
        return int(self._doc_counts[-1])

    def doc_end(self, k: int) -> int:
        """The global token offset just after document ``k`` (one read of 8 bytes)."""
        shard = int(np.searchsorted(self._doc_counts, k, side="right")) - 1
        local = k - int(self._doc_counts[shard])
        ends = map_array(
            self._doc_files[shard], dtype="int64", count=self.manifest.shards[shard].docs
        )
        return int(self._tok_offsets[shard]) + int(ends[local])

    def doc_ends(self) -> DocEnds:
        """Every document's end offset in the global stream, read through the maps."""
        parts = [
            map_array(f, dtype="int64", count=s.docs)
            for f, s in zip(self._doc_files, self.manifest.shards)
        ]
        return DocEnds(parts, self._tok_offsets[:-1].tolist())

    def answers(self, first: int, stop: int) -> np.ndarray:
        """Answer tokens of examples ``[first, stop)`` (SFT; a temporary array)."""
        out = []
        for f, s, lo in zip(self._answer_files, self.manifest.shards, self._doc_counts[:-1]):
            a, b = max(first - int(lo), 0), min(stop - int(lo), s.docs)
            if f is not None and a < b:
                part = map_array(f, dtype="uint32", count=s.docs)[a:b]
                out.append(np.asarray(part, dtype=np.int64))
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def split(self, val_fraction: float) -> Split:
        """[Note: validation by documents]."""
        docs = self.documents
        n_val = int(docs * val_fraction)
        if self.manifest.sft:
            return Split(train_end=docs - n_val, val_docs=n_val, by_tokens=False)
        if n_val or val_fraction == 0:
            end = self.doc_end(docs - n_val - 1) if docs - n_val > 0 else 0
            return Split(train_end=end, val_docs=n_val, by_tokens=False)
        return Split(
            train_end=len(self.tokens) - int(len(self.tokens) * val_fraction),
            val_docs=0,
            by_tokens=True,
        )

    def sft_rows(
        self, *, first: int, stop: int, seq_len: int, pad_id: int, packed: bool
    ) -> PackedRows:
        """Packed rows of examples ``[first, stop)``; their layout is built once and kept
        in ``layout_dir`` (when given), so later opens map it ([Note: SFT layout cache])."""
        assert self.mask is not None
        lo = self.doc_end(first - 1) if first else 0
        hi = self.doc_end(stop - 1) if stop else 0
        ends = _Window(self.doc_ends(), first=first, stop=stop, start=lo)
        mask = self.mask.view(lo, hi)
        key = f"{self.manifest.created}|{self.manifest.counts}|{self.root.resolve()}"
        key += f"|{first}|{stop}|{seq_len + 1}|{packed}"
        path = None
        if self.layout_dir is not None:
            name = hashlib.sha256(key.encode()).hexdigest()[:24]
            path = self.layout_dir / f"layout-{name}.rows"
        layout = Layout.load(path) if path is not None else None
        if layout is None:
            layout = _build(
                mask, ends, self.answers, first=first, seq_len=seq_len, packed=packed, out=path
            )
        return PackedRows(
            self.tokens.view(lo, hi),
            mask,
            ends,
            layout=layout,
            seq_len=seq_len,
            pad_id=pad_id,
            packed=packed,
        )


def _build(
    mask: TokenStream,
    ends: DocEnds,
    answers: Callable[[int, int], np.ndarray],
    *,
    first: int,
    seq_len: int,
    packed: bool,
    out: Path | None,
) -> Layout:
    """The layout of the window ``ends``, written to ``out`` and mapped when it can be
    ([Note: SFT layout cache]), else in memory."""

    def shifted(lo: int, hi: int) -> np.ndarray:
        return answers(first + lo, first + hi)

    if out is not None:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            return build_layout(mask, ends, shifted, length=seq_len + 1, packed=packed, out=out)
        except OSError:
            pass  # a read-only cache: the layout is built in memory at every open
    return build_layout(mask, ends, shifted, length=seq_len + 1, packed=packed)


class _Window(DocEnds):
    """The ends of documents ``[first, stop)`` of ``ends``, measured from ``start``."""

    def __init__(self, ends: DocEnds, *, first: int, stop: int, start: int) -> None:
        super().__init__(ends.parts, ends.offsets, start=start)
        self._first, self._stop = first, stop

    def __len__(self) -> int:
        return self._stop - self._first

    def all(self, first: int, stop: int) -> np.ndarray:
        return super().all(self._first + first, self._first + stop)
