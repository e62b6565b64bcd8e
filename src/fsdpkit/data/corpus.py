"""Reading text: the built-in corpus or the user's files, into one token stream.

The built-in corpus is the Python standard library's own ``*.py`` sources: every
machine that runs fsdpkit has them, so the default run needs no download. Files are
read in sorted path order and documents are joined in that order, so the stream is
identical on every rank and every run (for one Python version). Reading stops after
``data.max_bytes`` bytes of text, which bounds start-up time on huge corpora.

``data.path`` may be a text file, a directory (text files found recursively, sorted),
a glob pattern, or JSONL (one JSON object per line, text under ``data.text_field``).
Every rank reads and tokenizes the whole (bounded) corpus itself; the loader then gives
each rank a disjoint share of the sequences.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

from fsdpkit.config import DataConfig
from fsdpkit.data.errors import DataError
from fsdpkit.data.tokenizer import BulkEncoder, Tokenizer, separator_ids

TEXT_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown", ".rst", ".py", ".jsonl"})
"""Files picked up when ``data.path`` is a directory or a glob matches a directory."""

_BUILTIN_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
"""Standard-library folders left out of the built-in corpus: installed third-party
packages (they differ per machine) and the test suites (huge, repetitive)."""


class _Budget:
    """Bytes of text still allowed by ``data.max_bytes``, shared by all files."""

    def __init__(self, total: int) -> None:
        self.remaining = max(total, 0)

    def take(self, text: str) -> str:
        """``text`` cut to what is left of the budget (at a character boundary)."""
        data = text.encode("utf-8")
        if len(data) > self.remaining:
            data = data[: self.remaining]
            text = data.decode("utf-8", errors="ignore")
        self.remaining -= len(data)
        return text


def load_token_stream(cfg: DataConfig, tokenizer: Tokenizer) -> torch.Tensor:
    """The whole corpus as one 1-D int64 tensor, deterministic for a given config."""
    docs = read_documents(cfg)
    if isinstance(tokenizer, BulkEncoder):
        tokens = tokenizer.encode_documents(docs)
    else:
        tokens = _encode_slowly(docs, tokenizer)
    if tokens.numel() == 0:
        raise DataError(
            f"{describe_source(cfg)} holds no text: nothing to train on. Point data.path "
            "at non-empty text files (or leave it empty for the built-in corpus) and check "
            f"that data.max_bytes ({cfg.max_bytes}) is positive."
        )
    return tokens.to(torch.int64)


def _encode_slowly(docs: list[str], tokenizer: Tokenizer) -> torch.Tensor:
    """Token by token, for tokenizers without a bulk path (e.g. a user's own)."""
    sep = separator_ids(tokenizer)
    ids: list[int] = []
    for i, doc in enumerate(docs):
        if i:
            ids.extend(sep)
        ids.extend(tokenizer.encode(doc))
    return torch.tensor(ids, dtype=torch.int64)


def describe_source(cfg: DataConfig) -> str:
    """How error messages name the data: the config field and its value."""
    if cfg.path:
        return f"data.path ({cfg.path})"
    return f"the built-in corpus (Python standard library at {stdlib_dir()})"


def read_documents(cfg: DataConfig) -> list[str]:
    """The non-empty documents of the configured source, at most ``max_bytes`` in all."""
    budget = _Budget(cfg.max_bytes)
    files = resolve_files(cfg.path) if cfg.path else stdlib_files()
    docs: list[str] = []
    for file in files:
        if budget.remaining <= 0:
            break
        if file.suffix == ".jsonl":
            docs.extend(_read_jsonl(file, cfg=cfg, budget=budget))
        else:
            docs.append(_read_text(file, budget=budget, cfg=cfg))
    return [doc for doc in docs if doc]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> Iterator[Path]:
    """The standard library's ``*.py`` files in sorted path order, lazily."""
    for file in _walk_sorted(stdlib_dir(), skip_dirs=_BUILTIN_SKIP_DIRS):
        if file.suffix == ".py":
            yield file


def _walk_sorted(root: Path, *, skip_dirs: frozenset[str] = frozenset()) -> Iterator[Path]:
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
                yield from _walk_sorted(Path(entry.path), skip_dirs=skip_dirs)
        elif entry.is_file():
            yield Path(entry.path)


def resolve_files(path: str) -> list[Path]:
    """The files ``data.path`` names: one file, a directory's text files, or a glob's."""
    given = Path(path).expanduser()
    if given.is_file():
        return [given]
    if given.is_dir():
        files = _text_files(given)
        if not files:
            raise DataError(
                f"data.path: directory {given} has no text files (looked recursively for "
                f"{', '.join(sorted(TEXT_SUFFIXES))}). Put text files there, or point "
                "data.path at a file or a glob pattern such as 'corpus/**/*.txt'."
            )
        return files
    if any(ch in path for ch in "*?["):
        return _glob_files(path)
    raise DataError(
        f"data.path: {given} does not exist (relative paths start at {Path.cwd()}). Fix "
        "the path, or leave data.path empty to train on the built-in corpus."
    )


def _text_files(directory: Path) -> list[Path]:
    return [f for f in _walk_sorted(directory) if f.suffix in TEXT_SUFFIXES]


def _glob_files(pattern: str) -> list[Path]:
    """Matches of ``pattern`` (``**`` recurses), sorted; matched directories expanded."""
    files: list[Path] = []
    for match in sorted(glob.glob(os.path.expanduser(pattern), recursive=True)):
        found = Path(match)
        if found.is_dir():
            files.extend(_text_files(found))
        elif found.is_file():
            files.append(found)
    if not files:
        raise DataError(
            f"data.path: the glob pattern {pattern!r} matches no files (relative patterns "
            f"start at {Path.cwd()}). Fix the pattern (use '**' to search subdirectories) "
            "or leave data.path empty to train on the built-in corpus."
        )
    return files


SNIFF_BYTES = 65536
"""How much of each file ``binary_reason`` looks at."""
MAX_INVALID_UTF8 = 0.02
"""Share of invalid UTF-8 bytes above which a file counts as binary (text in another
encoding, e.g. Latin-1 with many accents, can exceed it too: data.allow_binary)."""


def binary_reason(raw: bytes) -> str | None:
    """Why ``raw`` (a file's first bytes) looks binary rather than text, or None."""
    sample = raw[:SNIFF_BYTES]
    if b"\0" in sample:
        return "it contains NUL bytes"
    valid = len(sample.decode("utf-8", errors="ignore").encode("utf-8"))
    bad = max(len(sample) - valid - 3, 0)  # up to 3 bytes: a character cut at the end
    if sample and bad / len(sample) > MAX_INVALID_UTF8:
        return f"{100 * bad / len(sample):.0f}% of its first {len(sample):,} bytes are not UTF-8"
    return None


def _refuse_binary(file: Path, raw: bytes, cfg: DataConfig) -> None:
    why = None if cfg.allow_binary else binary_reason(raw)
    if why:
        raise DataError(
            f"data.path: {file} does not look like text ({why}); training on it would "
            "model the bytes of a program or archive, not language. Point data.path at "
            "text files (.txt, .md, .py, .jsonl...), or set data.allow_binary = true to "
            "train on it anyway."
        )


def _read_text(file: Path, *, budget: _Budget, cfg: DataConfig) -> str:
    """One file as one document, decoded as UTF-8 (bad bytes become U+FFFD); a file
    that looks binary is refused unless data.allow_binary."""
    try:
        with file.open("rb") as f:
            raw = f.read(budget.remaining)
    except OSError as e:
        raise _unreadable(file, e) from e
    _refuse_binary(file, raw, cfg)
    # final=False drops a multi-byte character cut in half by the byte budget.
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw, final=False)
    budget.remaining -= len(raw)
    return text


def _read_jsonl(file: Path, *, cfg: DataConfig, budget: _Budget) -> Iterator[str]:
    """Each record's ``text_field`` as one document; the first bad line is an error."""
    text_field = cfg.text_field
    try:
        with file.open("rb") as head:
            _refuse_binary(file, head.read(SNIFF_BYTES), cfg)
        with file.open(encoding="utf-8", errors="replace") as f:
            for line_no, line in enumerate(f, start=1):
                if budget.remaining <= 0:
                    return
                if line.strip():
                    yield budget.take(_record_text(line, file, line_no, text_field))
    except OSError as e:
        raise _unreadable(file, e) from e


def _record_text(line: str, file: Path, line_no: int, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{file}:{line_no}: not valid JSON ({e.msg}). A .jsonl file must hold one JSON "
            "object per line; fix or remove that line."
        ) from e
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        present = ", ".join(map(repr, record)) if isinstance(record, dict) else "none"
        raise DataError(
            f"{file}:{line_no}: the record has no string field {text_field!r} (fields "
            f"present: {present}). Set data.text_field to the field that holds the text, "
            "or fix that line."
        )
    return text


def _unreadable(file: Path, error: OSError) -> DataError:
    return DataError(
        f"data.path: cannot read {file} ({error.strerror or error}). Check the file's "
        "permissions, or leave it out of data.path."
    )
