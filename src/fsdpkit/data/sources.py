"""Which files ``data.path`` names, and what kind of source each one is.

``data.path`` (and each ``fsdpkit data prepare SRC``) may be

- a file: text (``.txt .md .rst .py ...``: one document per file), ``.jsonl`` (also
  ``.jsonl.gz`` / ``.jsonl.zst``), ``.json`` (an array of records, or one record),
  ``.parquet``, or an ``.arrow`` file;
- a directory written by ``datasets.save_to_disk`` (``state.json`` + ``data-*.arrow``;
  a ``DatasetDict``'s ``train`` split);
- a local Hugging Face dataset repository: record files anywhere below it (``data/*``,
  ``*.jsonl``...). File names name the split as the Hub does (``train-00000-of-00002``,
  ``data/train/...``, ``test.jsonl``): only the train split is read, the others are listed
  as left out; its README / LICENSE files beside record files are not data;
- a directory of text files (found recursively, sorted), or a glob pattern.

Files are taken in sorted path order, so the result is the same on every rank and run.
Nothing is ever downloaded.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fsdpkit.data.errors import DataError

TEXT_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown", ".rst", ".py"})
"""Plain-text files: one document each."""
RECORD_SUFFIXES = frozenset({".jsonl", ".json", ".parquet", ".arrow"})
"""Files of records (rows); ``.jsonl``/``.json`` may also end in ``.gz`` or ``.zst``."""
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
METADATA_NAMES = frozenset(
    {
        "dataset_info.json",
        "dataset_infos.json",
        "dataset_dict.json",
        "state.json",
        "config.json",
        "manifest.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
)
"""JSON files of dataset and model directories that describe data rather than hold it."""
REPO_FILES = ("README", "LICENSE", "CITATION", "CHANGELOG")
"""Text files of a dataset repository that describe it (left out beside record files)."""
SPLITS = {"train": "train", "validation": "validation", "valid": "validation", "val": "validation"}
SPLITS |= {"dev": "validation", "test": "test", "eval": "validation"}
"""Split words in Hub file names, and the split each one means."""


@dataclass(frozen=True)
class Source:
    """One file to read."""

    path: Path
    kind: str
    """text, jsonl, json, parquet or arrow."""
    compression: str | None = None
    """gzip or zstd (jsonl/json only)."""

    @property
    def records(self) -> bool:
        """Rows of fields (everything but plain text files)."""
        return self.kind != "text"


@dataclass
class Resolved:
    """The sources of one ``data.path``, and what was deliberately left out of it."""

    sources: list[Source]
    left_out: list[str] = field(default_factory=list)
    """Human-readable notes: other splits, README files beside records."""


def classify(path: Path) -> Source | None:
    """The source kind of a file from its name, or None for a file that is not data."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    if path.name in METADATA_NAMES:
        return None
    if last in (".jsonl", ".json") or (last in RECORD_SUFFIXES and not compression):
        return Source(path=path, kind=last[1:], compression=compression)
    if last in TEXT_SUFFIXES and not compression:
        return Source(path=path, kind="text")
    return None


def split_of(relative: Path) -> str | None:
    """The split a Hub-style file name names (train/validation/test), or None."""
    words = re.split(r"[/\\._\- 0-9]+", str(relative.with_suffix("")).lower())
    for word in words:
        if word in SPLITS:
            return SPLITS[word]
    return None


def resolve(path: str) -> Resolved:
    """The sources ``path`` names (see the module docstring), in sorted order."""
    given = Path(path).expanduser()
    if given.is_file():
        source = classify(given) or Source(path=given, kind="text")
        return Resolved([source])
    if given.is_dir():
        return _resolve_dir(given)
    if any(ch in path for ch in "*?["):
        return _resolve_glob(path)
    raise DataError(
        f"data.path: {given} does not exist (relative paths start at {Path.cwd()}). Fix "
        "the path, or leave data.path empty to train on the built-in corpus."
    )


def _resolve_glob(pattern: str) -> Resolved:
    out = Resolved([])
    for match in sorted(glob.glob(os.path.expanduser(pattern), recursive=True)):
        found = Path(match)
        if found.is_dir():
            inner = _resolve_dir(found, required=False)
            out.sources += inner.sources
            out.left_out += inner.left_out
        elif found.is_file() and (source := classify(found)) is not None:
            out.sources.append(source)
    if not out.sources:
        raise DataError(
            f"data.path: the glob pattern {pattern!r} matches no data files (relative "
            f"patterns start at {Path.cwd()}). Fix the pattern (use '**' to search "
            "subdirectories) or leave data.path empty to train on the built-in corpus."
        )
    return out


def _resolve_dir(root: Path, *, required: bool = True) -> Resolved:
    if (root / "dataset_dict.json").is_file():
        return _saved_dict(root)
    if (root / "state.json").is_file() and (root / "dataset_info.json").is_file():
        return Resolved(_saved_arrow(root))
    found = [s for f in walk_sorted(root) if (s := classify(f)) is not None]
    records = [s for s in found if s.records]
    if not records:
        if not found and required:
            raise DataError(
                f"data.path: directory {root} has no data files (looked recursively for "
                f"{', '.join(sorted(TEXT_SUFFIXES | RECORD_SUFFIXES))}, .jsonl.gz, "
                ".jsonl.zst). Put files there, or point data.path at a file or a glob."
            )
        return Resolved(found)
    about = [s for s in found if not s.records and s.path.name.upper().startswith(REPO_FILES)]
    out = Resolved([s for s in found if s not in about])
    if about:
        names = ", ".join(s.path.name for s in about[:3])
        out.left_out.append(f"{names} of {root}: a dataset repository's own files, not data")
    return _train_split(out, root)


def _train_split(found: Resolved, root: Path) -> Resolved:
    """Only the train split when file names name splits (Hub layout)."""
    splits = {s.path: split_of(s.path.relative_to(root)) for s in found.sources}
    if not any(splits.values()):
        return found
    train = [s for s in found.sources if splits[s.path] in ("train", None)]
    others = sorted({v for v in splits.values() if v and v != "train"})
    if not train:
        raise DataError(
            f"data.path: {root} holds the split(s) {', '.join(others)} but no train split "
            "(file names with 'train'). Point data.path at the file(s) to train on."
        )
    count = len(found.sources) - len(train)
    if count:
        found.left_out.append(f"{count} file(s) of the {', '.join(others)} split(s) of {root}")
    return Resolved(train, found.left_out)


def _saved_arrow(root: Path) -> list[Source]:
    """The Arrow files of a ``Dataset.save_to_disk`` directory, in the dataset's order."""
    try:
        state = json.loads((root / "state.json").read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(
            f"data.path: {root}/state.json is not the state file datasets.save_to_disk "
            f"writes ({exc}); save the dataset again."
        ) from exc
    return [Source(path=root / name, kind="arrow") for name in names]


def _saved_dict(root: Path) -> Resolved:
    """The train split of a ``DatasetDict.save_to_disk`` directory."""
    try:
        splits = json.loads((root / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"data.path: {root}/dataset_dict.json is not readable ({exc}).") from exc
    if "train" not in splits:
        raise DataError(
            f"data.path: the DatasetDict in {root} has the splits {', '.join(splits)} but no "
            "'train'; point data.path at the split directory to train on."
        )
    others = [s for s in splits if s != "train"]
    notes = [f"the {', '.join(others)} split(s) of {root}"] if others else []
    return Resolved(_saved_arrow(root / "train"), notes)


def walk_sorted(root: Path, *, skip_dirs: frozenset[str] = frozenset()) -> Iterator[Path]:
    """Files under ``root`` depth-first in sorted name order; hidden entries skipped."""
    try:
        entries = sorted(os.scandir(root), key=lambda entry: entry.name)
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(".") or entry.name == "__pycache__":
            continue
        if entry.is_dir():
            if entry.name not in skip_dirs:
                yield from walk_sorted(Path(entry.path), skip_dirs=skip_dirs)
        elif entry.is_file():
            yield Path(entry.path)
