"""What a prepare will do: the sources, text or SFT, and the work units (one shard each).

Sources are cut into pieces of about ``UNIT_BYTES``: text and ``.jsonl`` files at a line
(text: a newline that ends a run of whitespace, where tokenizers split anyway), parquet
files at row groups, Arrow files at rows; compressed and ``.json`` files are one piece.
Consecutive pieces fill a unit up to ``UNIT_BYTES``. The cut depends only on the data,
never on the number of workers, so every ``--workers`` writes the same tokens.

``data.max_bytes`` stops planning after that many source bytes; a text or ``.jsonl``
file crossing the limit is cut at a line. What is left out is counted and printed.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fsdpkit.config import DataConfig
from fsdpkit.data.errors import DataError
from fsdpkit.data.readers import Piece, Records, arrow_table, optional, read_range
from fsdpkit.data.schemas import detect, no_schema, parse_columns, rename
from fsdpkit.data.sources import Resolved, Source, resolve, walk_sorted

UNIT_BYTES = 16 * 2**20
"""Source bytes per work unit and shard: big enough to amortize a task, small enough
that a worker holds one unit's tokens in memory and progress moves smoothly."""
_SCAN = 65536
_BUILTIN_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
"""Standard-library folders left out of the built-in corpus: installed third-party
packages (they differ per machine) and the test suites (huge, repetitive)."""


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> Iterator[Path]:
    """The standard library's ``*.py`` files in sorted path order, lazily."""
    for file in walk_sorted(stdlib_dir(), skip_dirs=_BUILTIN_SKIP_DIRS):
        if file.suffix == ".py":
            yield file


def resolve_config(cfg: DataConfig) -> Resolved:
    """The sources of ``data.path`` (the built-in corpus when it is empty)."""
    if not cfg.path:
        return Resolved([Source(path=f, kind="text") for f in stdlib_files()])
    return resolve(cfg.path)


def describe_source(cfg: DataConfig) -> str:
    """How error messages name the data: the config field and its value."""
    if cfg.path:
        return f"data.path ({cfg.path})"
    return f"the built-in corpus (Python standard library at {stdlib_dir()})"


def first_record(source: Source) -> tuple[str, object] | None:
    """(where, record) of the first record of a record source, or None if it has none."""
    size = source.path.stat().st_size
    piece = Piece(source=0, lo=0, hi=min(size, _SCAN * 16), nbytes=0)
    if source.kind == "jsonl" and not source.compression:
        raw = read_range(source.path, lo=0, hi=piece.hi)
        cut = raw.rfind(b"\n") + 1 if piece.hi < size else len(raw)
        piece = Piece(source=0, lo=0, hi=cut or piece.hi, nbytes=0)
    elif source.kind in ("parquet", "arrow"):
        piece = Piece(source=0, lo=0, hi=1, nbytes=0)
    records = Records(source, piece)
    for i, record in records:
        return records.where(i), record
    return None


def data_kind(cfg: DataConfig, resolved: Resolved | None = None) -> str:
    """``text`` or ``sft``: data.format / data.schema when they say, else what the first
    record looks like ([Note: SFT schemas]); a record matching nothing is an error."""
    if cfg.format != "auto":
        return cfg.format
    if cfg.schema != "auto":
        return "text" if cfg.schema == "text" else "sft"
    if resolved is None:
        if not cfg.path:
            return "text"
        resolved = resolve_config(cfg)
    records = [s for s in resolved.sources if s.records]
    if not records:
        return "text"
    found = first_record(records[0])
    if found is None:
        return "text"
    where, record = found
    schema = detect(rename(record, parse_columns(cfg.columns)), text_field=cfg.text_field)
    if schema is None:
        raise no_schema(record, where, text_field=cfg.text_field)
    return "text" if schema == "text" else "sft"


@dataclass
class Plan:
    """The work of one prepare."""

    sources: list[Source]
    units: list[list[Piece]] = field(default_factory=list)
    planned_bytes: int = 0
    left_out_bytes: int = 0
    left_out_files: int = 0
    notes: list[str] = field(default_factory=list)


def plan_units(resolved: Resolved, *, max_bytes: int | None, unit_bytes: int | None = None) -> Plan:
    """Pieces of every source within ``max_bytes``, grouped into units (module doc)."""
    unit_bytes = unit_bytes or UNIT_BYTES
    plan = Plan(sources=list(resolved.sources), notes=list(resolved.left_out))
    budget = max_bytes if max_bytes is not None else None
    pieces: list[Piece] = []
    for index, source in enumerate(plan.sources):
        size = _size(source)
        if budget is not None and budget <= 0:
            plan.left_out_bytes += size
            plan.left_out_files += 1
            continue
        end = size if budget is None else min(size, budget)
        cut = list(_pieces(index, source, end=end, size=size, unit=unit_bytes))
        used = sum(p.nbytes for p in cut) if _splits_bytes(source) else size
        plan.left_out_bytes += size - used
        plan.planned_bytes += used
        if budget is not None:
            budget -= used
        pieces += cut
    plan.units = _group(pieces, unit_bytes)
    return plan


def _size(source: Source) -> int:
    try:
        return source.path.stat().st_size
    except OSError as exc:
        raise DataError(f"data.path: cannot read {source.path} ({exc.strerror or exc}).") from exc


def _group(pieces: list[Piece], unit: int) -> list[list[Piece]]:
    units: list[list[Piece]] = []
    filled = unit
    for piece in pieces:
        if filled >= unit:
            units.append([])
            filled = 0
        units[-1].append(piece)
        filled += max(piece.nbytes, 1)
    return units


def _splits_bytes(source: Source) -> bool:
    return source.kind in ("text", "jsonl") and not source.compression


def _pieces(index: int, source: Source, *, end: int, size: int, unit: int) -> Iterator[Piece]:
    if _splits_bytes(source):
        yield from _byte_pieces(index, source, end=end, size=size, unit=unit)
    elif source.kind == "parquet":
        yield from _parquet_pieces(index, source, unit=unit)
    elif source.kind == "arrow":
        yield from _arrow_pieces(index, source, size=size, unit=unit)
    else:
        yield Piece(source=index, lo=0, hi=size, nbytes=size)


def _byte_pieces(index: int, source: Source, *, end: int, size: int, unit: int) -> Iterator[Piece]:
    """Byte ranges of about ``unit`` bytes, cut after a newline ([module doc])."""
    text = source.kind == "text"
    if end < size and not text:  # a .jsonl cut by max_bytes ends at its last whole line
        end = _line_end(source.path, end, backwards=True)
    lo = 0
    while lo < end:
        hi = end if end - lo <= unit * 1.5 else _line_end(source.path, lo + unit, text=text)
        hi = min(hi, end)
        yield Piece(source=index, lo=lo, hi=hi, nbytes=hi - lo, ends_document=hi == end)
        lo = hi


def _line_end(path: Path, at: int, *, text: bool = False, backwards: bool = False) -> int:
    """The offset just after a newline at or after ``at`` (before it: ``backwards``); for
    text, one followed by a non-whitespace byte. The file's end if there is none."""
    if backwards:
        raw = read_range(path, lo=max(0, at - 16 * _SCAN), hi=at)
        return at - len(raw) + raw.rfind(b"\n") + 1 if b"\n" in raw else 0
    size = path.stat().st_size
    while at < size:
        raw = read_range(path, lo=at, hi=min(size, at + _SCAN + 1))
        pos = raw.find(b"\n")
        while pos != -1 and pos + 1 < len(raw):
            if not text or raw[pos + 1] not in b" \t\r\n":
                return at + pos + 1
            pos = raw.find(b"\n", pos + 1)
        at += max(len(raw) - 1, 1)
    return size


def _parquet_pieces(index: int, source: Source, *, unit: int) -> Iterator[Piece]:
    pq = optional("pyarrow.parquet", f"reading {source.path}")
    meta = pq.ParquetFile(source.path).metadata
    lo, rows, nbytes, base = 0, 0, 0, 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        nbytes += sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        rows += group.num_rows
        if nbytes >= unit or g == meta.num_row_groups - 1:
            yield Piece(source=index, lo=lo, hi=g + 1, nbytes=nbytes, row_base=base)
            lo, base, rows, nbytes = g + 1, base + rows, 0, 0


def _arrow_pieces(index: int, source: Source, *, size: int, unit: int) -> Iterator[Piece]:
    rows = arrow_table(source).num_rows
    step = max(1, int(rows * unit / max(size, 1)))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        yield Piece(source=index, lo=lo, hi=hi, nbytes=size * (hi - lo) // rows, row_base=lo)
