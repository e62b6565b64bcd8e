"""Reading one piece of one source: text documents, or records with where they came from.

A piece is a byte range of a text or ``.jsonl`` file (cut after a newline, so no line or
character is split), a range of row groups of a parquet file, a range of rows of an
Arrow file, or a whole compressed / ``.json`` file. ``fsdpkit.data.plan`` cuts sources
into pieces; each prepare worker reads its own. Errors name the file and the line
(``.jsonl``) or the record / row number.
"""

from __future__ import annotations

import codecs
import gzip
import importlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fsdpkit.data.errors import DataError
from fsdpkit.data.sources import Source

EXTRA = "pip install 'fsdpkit[data]'"
SNIFF_BYTES = 65536
"""How much of each text file ``binary_reason`` looks at."""
MAX_INVALID_UTF8 = 0.02
"""Share of invalid UTF-8 bytes above which a file counts as binary (text in another
encoding, e.g. Latin-1 with many accents, can exceed it too: data.allow_binary)."""
ROWS_PER_BATCH = 8192


@dataclass(frozen=True)
class Piece:
    """Part of source ``source``: bytes (text, jsonl) or rows / row groups ``[lo, hi)``."""

    source: int
    lo: int
    hi: int
    nbytes: int
    """Source bytes this piece stands for (progress and data.max_bytes)."""
    ends_document: bool = True
    """Text: the piece ends its file (the document ends here)."""
    row_base: int = 0
    """Parquet: the row number of the first row group's first row."""


def optional(module: str, what: str) -> Any:
    """Import an optional dependency, or a DataError naming the extra that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{what} needs the `{module}` package: {EXTRA}.") from None


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


def refuse_binary(file: Path, raw: bytes) -> None:
    why = binary_reason(raw)
    if why:
        raise DataError(
            f"data.path: {file} does not look like text ({why}); training on it would "
            "model the bytes of a program or archive, not language. Point data.path at "
            "text files (.txt, .md, .py, .jsonl...), or set data.allow_binary = true to "
            "train on it anyway."
        )


def unreadable(file: Path, error: OSError) -> DataError:
    return DataError(
        f"data.path: cannot read {file} ({error.strerror or error}). Check the file's "
        "permissions, or leave it out of data.path."
    )


def read_range(file: Path, *, lo: int, hi: int) -> bytes:
    try:
        with file.open("rb") as f:
            f.seek(lo)
            return f.read(hi - lo)
    except OSError as exc:
        raise unreadable(file, exc) from exc


def text_piece(source: Source, piece: Piece, *, allow_binary: bool) -> str:
    """A text piece decoded as UTF-8 (bad bytes become U+FFFD; a character cut by
    data.max_bytes at the end is dropped); the file's start is checked for binary."""
    raw = read_range(source.path, lo=piece.lo, hi=piece.hi)
    if piece.lo == 0 and not allow_binary:
        refuse_binary(source.path, raw)
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw, final=False)


def _open_text(source: Source) -> IO[str]:
    try:
        raw: Any = source.path.open("rb")
        if source.compression == "gzip":
            raw = gzip.GzipFile(fileobj=raw)
        elif source.compression == "zstd":
            zstd = optional("zstandard", f"reading {source.path} (.zst)")
            raw = zstd.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
    except OSError as exc:
        raise unreadable(source.path, exc) from exc


class Records:
    """The records of one piece: ``for i, record in reader`` and ``reader.where(i)``."""

    def __init__(self, source: Source, piece: Piece) -> None:
        self.source, self.piece = source, piece
        self._lines: list[int] = []
        self._as_lines = source.kind == "jsonl"
        """A .json file holding one JSON value per line is read as .jsonl (as datasets
        does; torchtitan's c4 test file is one)."""

    def where(self, i: int) -> str:
        """``file:line`` (jsonl), ``file: record N`` (json), ``file: row N`` (tables)."""
        path = self.source.path
        if self._as_lines:
            before = 0
            if self.piece.lo:  # lines before this piece: counted only when an error needs it
                before = read_range(path, lo=0, hi=self.piece.lo).count(b"\n")
            return f"{path}:{before + self._lines[i]}"
        if self.source.kind == "json":
            return f"{path}: record {i}"
        return f"{path}: row {self.piece.row_base + i}"

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        kind = self.source.kind
        if kind == "jsonl":
            return self._jsonl()
        if kind == "json":
            return self._json()
        return enumerate(self._table_rows())

    def _jsonl(self) -> Iterator[tuple[int, Any]]:
        if self.source.compression:
            with _open_text(self.source) as f:
                yield from self._parse_lines(f)
        else:
            raw = read_range(self.source.path, lo=self.piece.lo, hi=self.piece.hi)
            yield from self._parse_lines(raw.decode("utf-8", errors="replace").splitlines())

    def _parse_lines(self, lines: Any) -> Iterator[tuple[int, Any]]:
        for line_no, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            self._lines.append(line_no)
            i = len(self._lines) - 1
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{self.where(i)}: not valid JSON ({exc.msg}). A .jsonl file must hold "
                    "one JSON object per line; fix or remove that line."
                ) from exc

    def _json(self) -> Iterator[tuple[int, Any]]:
        with _open_text(self.source) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                if exc.msg != "Extra data":
                    raise DataError(
                        f"{self.source.path}: not valid JSON ({exc.msg} at line {exc.lineno}). "
                        "A .json source holds an array of records (or one record); one "
                        "record per line is .jsonl."
                    ) from exc
                data = None  # one value per line: JSON lines
            except OSError as exc:
                raise unreadable(self.source.path, exc) from exc
        if data is None:
            self._as_lines = True
            with _open_text(self.source) as f:
                yield from self._parse_lines(f)
            return
        yield from enumerate(data if isinstance(data, list) else [data])

    def _table_rows(self) -> Iterator[Any]:
        for batch in table_batches(self.source, self.piece):
            yield from batch.to_pylist()


def table_batches(
    source: Source, piece: Piece, *, columns: list[str] | None = None
) -> Iterator[Any]:
    """pyarrow record batches of a parquet or Arrow piece (only ``columns`` if given)."""
    pa = optional("pyarrow", f"reading {source.path}")
    if source.kind == "parquet":
        pq = optional("pyarrow.parquet", f"reading {source.path}")
        try:
            pf = pq.ParquetFile(source.path)
            groups = list(range(piece.lo, piece.hi))
            yield from pf.iter_batches(ROWS_PER_BATCH, row_groups=groups, columns=columns)
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{source.path}: not a readable parquet file ({exc}).") from exc
        return
    table = arrow_table(source)
    if columns:
        table = table.select(columns)
    yield from table.slice(piece.lo, piece.hi - piece.lo).to_batches(ROWS_PER_BATCH)


def arrow_table(source: Source) -> Any:
    """An Arrow file (stream format, as datasets writes it, or file format), memory-mapped."""
    pa = optional("pyarrow", f"reading {source.path}")
    try:
        mapped = pa.memory_map(str(source.path))
        try:
            return pa.ipc.open_stream(mapped).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_file(pa.memory_map(str(source.path))).read_all()
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{source.path}: not a readable Arrow file ({exc}).") from exc


def table_columns(source: Source) -> list[str]:
    """The column names of a parquet or Arrow source (from its schema, no rows read)."""
    if source.kind == "parquet":
        pq = optional("pyarrow.parquet", f"reading {source.path}")
        return list(pq.ParquetFile(source.path).schema_arrow.names)
    return list(arrow_table(source).schema.names)
