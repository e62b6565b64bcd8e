"""A prepared dataset on disk: its manifest and shard files.

    DIR/manifest.json          written last: a directory without it is not a dataset
    DIR/shard-00000.tokens     token ids, little-endian ``dtype`` (uint16 or uint32)
    DIR/shard-00000.docs       int64: each document's end offset within the shard
    DIR/shard-00000.mask       SFT: uint8 per token, 1 where the loss counts
    DIR/shard-00000.answers    SFT: uint32 per example, its answer tokens
    DIR/tokenizer/             a copy of the tokenizer files (HF tokenizers)

The manifest records what the tokens were made from (each source's path, size, mtime
and sha256), with what (the tokenizer's fingerprint, the options that change tokens),
by which fsdpkit, and what came out (counts, schemas, each shard's sizes and crc32).
The text stream is every document followed by the separator (EOS, or a blank line
without one), shard after shard, in source order.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fsdpkit.data.errors import DataError

FORMAT = "fsdpkit-dataset"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SUFFIXES = {"tokens": None, "docs": "int64", "mask": "uint8", "answers": "uint32"}
"""Shard files and their dtypes (``tokens``: the manifest's dtype)."""


try:  # zlib-ng (a dependency): the same values as zlib's crc32, ~10x faster
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover
    _crc32 = zlib.crc32
crc32: Callable[[object, int], int] = _crc32  # type: ignore[assignment]
"""``crc32(buffer, running)`` of shard files (written by prepare, checked by inspect)."""


def token_dtype(vocab_size: int) -> str:
    """uint16 when every id fits (vocabularies up to 65,536), else uint32."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass(frozen=True)
class Shard:
    name: str
    tokens: int
    docs: int
    answer_tokens: int = 0
    crc32: dict[str, str] = field(default_factory=dict)
    """crc32 of each file by suffix (``fsdpkit data inspect --verify`` recomputes them)."""

    def files(self, root: Path, *, sft: bool) -> dict[str, Path]:
        names = ("tokens", "docs", "mask", "answers") if sft else ("tokens", "docs")
        return {s: root / f"{self.name}.{s}" for s in names}

    def sizes(self, dtype: str, *, sft: bool) -> dict[str, int]:
        """The byte size each file must have."""
        item = np.dtype(dtype).itemsize
        sizes = {"tokens": self.tokens * item, "docs": self.docs * 8}
        if sft:
            sizes |= {"mask": self.tokens, "answers": self.docs * 4}
        return sizes


@dataclass(frozen=True)
class Manifest:
    """What a prepared dataset holds and how it was made."""

    kind: str
    """``text`` (next-token prediction on every token) or ``sft`` (loss mask)."""
    dtype: str
    tokenizer: dict[str, Any]
    """``fingerprint`` of the tokenizer (kind, sha256, vocab_size, eos_id, path)."""
    options: dict[str, Any]
    """The settings that change the tokens (text_field, schema, columns, max_bytes...)."""
    sources: list[dict[str, Any]]
    """Each source file: path, size, mtime_ns, sha256."""
    shards: list[Shard]
    schemas: dict[str, int]
    """Rows per detected schema (SFT), or {"text": documents}."""
    counts: dict[str, int]
    """documents, tokens, answer_tokens, source_bytes, left_out_bytes, skipped_files."""
    fsdpkit_version: str
    created: str
    format: str = FORMAT
    version: int = VERSION

    @property
    def sft(self) -> bool:
        return self.kind == "sft"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def read(cls, root: Path) -> Manifest:
        """``root/manifest.json``; a DataError naming the file when it is not one."""
        path = root / MANIFEST
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DataError(
                f"{root} is not a prepared dataset (no {MANIFEST}): `fsdpkit data prepare` "
                "writes it last, so a prepare that was interrupted leaves none."
            ) from None
        except (OSError, ValueError) as exc:
            raise DataError(f"{path} is not readable JSON ({exc}); prepare again.") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise DataError(f"{path} is not an fsdpkit dataset manifest (format {FORMAT!r}).")
        if data.get("version") != VERSION:
            raise DataError(
                f"{path} has manifest version {data.get('version')}; this fsdpkit reads "
                f"version {VERSION}. Prepare the dataset again with this fsdpkit."
            )
        try:
            data["shards"] = [Shard(**s) for s in data["shards"]]
            return cls(**data)
        except (KeyError, TypeError) as exc:
            raise DataError(f"{path} is damaged ({exc}); prepare the dataset again.") from exc

    def problems(self, root: Path) -> list[str]:
        """Missing or torn shard files and counts that disagree (cheap: sizes only)."""
        out = []
        for shard in self.shards:
            files = shard.files(root, sft=self.sft)
            for suffix, size in shard.sizes(self.dtype, sft=self.sft).items():
                try:
                    actual = files[suffix].stat().st_size
                except OSError:
                    out.append(f"{files[suffix].name} is missing")
                    continue
                if actual != size:
                    out.append(f"{files[suffix].name} has {actual:,} bytes, expected {size:,}")
        total = sum(s.tokens for s in self.shards)
        if total != self.counts.get("tokens"):
            out.append(f"the shards hold {total:,} tokens, the manifest says {self.counts}")
        return out


def is_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory with a dataset manifest."""
    return path.is_dir() and (path / MANIFEST).is_file()


def open_manifest(root: Path) -> Manifest:
    """The manifest of a complete dataset; a DataError listing what is damaged."""
    manifest = Manifest.read(root)
    problems = manifest.problems(root)
    if problems:
        listed = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
        raise DataError(
            f"the prepared dataset {root} is damaged ({listed}). Run `fsdpkit data inspect "
            f"{root}` for the full list and prepare it again."
        )
    return manifest
