"""One prepare work unit: read its pieces, tokenize them in batches, write one shard.

Runs in a worker process (or inline for small data). Text: every document's ids, then
the separator (EOS, or a blank line without one); a document longer than
``PIECE_CHARS`` is encoded in parts cut after a newline (the batch API is parallel over
texts, not within one). SFT: each record normalized ([Note: SFT schemas]) and formatted
(fsdpkit.data.sft), ids with the answer-token mask.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from fsdpkit.config import DataConfig
from fsdpkit.data.errors import DataError
from fsdpkit.data.manifest import Shard, crc32
from fsdpkit.data.plan import plan_units, resolve_config
from fsdpkit.data.readers import Piece, Records, table_batches, table_columns, text_piece
from fsdpkit.data.schemas import (
    REQUIRED,
    Conversation,
    conversation,
    detect,
    no_schema,
    parse_columns,
    rename,
)
from fsdpkit.data.sft import Block, Example, Formatter
from fsdpkit.data.sources import Source
from fsdpkit.data.tokenizer import BulkEncoder, build_tokenizer, document_end, with_bos

PIECE_CHARS = 1 << 20
BATCH_CHARS = 4 << 20
"""Characters of text handed to one ``encode_many`` call."""
BATCH_ROWS = 512


@dataclass(frozen=True)
class Job:
    """What a worker needs (picklable): the unit, where to write, how to tokenize."""

    sources: list[Source]
    pieces: list[Piece]
    out: str
    name: str
    kind: str
    dtype: str
    cfg: DataConfig


@dataclass
class Result:
    shard: Shard
    schemas: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0
    empty_replies: int = 0
    """Empty assistant replies rendered but not trained (Conversation.untrained)."""


@cache
def _tokenizer(path: str | None) -> BulkEncoder:
    """One tokenizer per worker process (loading a tokenizer.json takes ~0.1 s)."""
    tok = build_tokenizer(DataConfig(tokenizer=path))
    assert isinstance(tok, BulkEncoder)
    return tok


def init_worker() -> None:
    """In a worker process: one thread per worker (the workers are the parallelism; a
    prepare in the calling process keeps the Rust batch API's threads instead)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


def run(job: Job) -> Result:
    """Process one unit and write its shard files; returns what the manifest records."""
    sink = _Sink(job)
    tok = _tokenizer(job.cfg.tokenizer)
    if job.kind == "text":
        _text_unit(job, tok=tok, sink=sink)
    else:
        formatter = Formatter(
            tokenizer=tok,  # type: ignore[arg-type]
            tokenizer_path=job.cfg.tokenizer,
            data_path=str(job.cfg.path),
        )
        batch: list[tuple[Conversation, object]] = []
        for conv, where in _conversations(job.sources, job.pieces, cfg=job.cfg):
            sink.schemas[conv.schema] += 1
            sink.empty_replies += len(conv.untrained)
            batch.append((conv, where))
            if len(batch) >= BATCH_ROWS:
                sink.block(formatter.block([c for c, _ in batch], [w for _, w in batch]))
                batch = []
        sink.block(formatter.block([c for c, _ in batch], [w for _, w in batch]))
    return sink.finish(sum(p.nbytes for p in job.pieces))


class _Sink:
    """Accumulates one shard's arrays, then writes them."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.parts: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.ends: list[int] = []
        self.answers: list[int] = []
        self.tokens = 0
        self.schemas: Counter[str] = Counter()
        self.empty_replies = 0

    def add(self, ids: np.ndarray, *, end: bool, mask: np.ndarray | None = None) -> None:
        self.parts.append(ids.astype(self.job.dtype, copy=False))
        self.tokens += len(ids)
        if mask is not None:
            self.masks.append(mask.astype(np.uint8))
            self.answers.append(int(mask.sum()))
        if end:
            self.ends.append(self.tokens)

    def block(self, block: Block) -> None:
        """Many examples at once (fsdpkit.data.sft.Block)."""
        self.parts.append(block.ids.astype(self.job.dtype, copy=False))
        self.masks.append(block.train.astype(np.uint8))
        self.answers += block.answers().tolist()
        self.ends += (self.tokens + np.cumsum(block.lengths)).tolist()
        self.tokens += len(block.ids)

    def finish(self, nbytes: int) -> Result:
        arrays = {
            "tokens": _concat(self.parts, self.job.dtype),
            "docs": np.asarray(self.ends, dtype=np.int64),
        }
        if self.job.kind == "sft":
            arrays["mask"] = _concat(self.masks, "uint8")
            arrays["answers"] = np.asarray(self.answers, dtype=np.uint32)
        crc = {
            s: write_array(Path(self.job.out) / f"{self.job.name}.{s}", a)
            for s, a in arrays.items()
        }
        shard = Shard(
            name=self.job.name,
            tokens=self.tokens,
            docs=len(self.ends),
            answer_tokens=int(sum(self.answers)),
            crc32=crc,
        )
        return Result(shard, dict(self.schemas), nbytes, empty_replies=self.empty_replies)


def _concat(parts: list[np.ndarray], dtype: str) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)


def write_array(path: Path, array: np.ndarray) -> str:
    """Write ``array``'s bytes to ``path`` and fsync; returns their crc32 (8 hex digits)."""
    data = memoryview(np.ascontiguousarray(array)).cast("B")  # type: ignore[arg-type]
    try:
        with path.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise DataError(f"cannot write {path} ({exc.strerror or exc}); check the disk.") from exc
    return f"{crc32(data, 0) & 0xFFFFFFFF:08x}"


def _text_unit(job: Job, *, tok: BulkEncoder, sink: _Sink) -> None:
    """Every document as ``document_ids`` lays it out, a long one arriving in parts: the
    BOS before its first part, the separator after its last ([Note: special tokens]);
    an empty document gets neither."""
    texts: list[str] = []
    ends: list[bool] = []
    last: list[int | None] = [None]  # the last token of the open document (None: none open)

    def flush() -> None:
        for ids, end in zip(tok.encode_many(texts), ends):
            if len(ids):
                if last[0] is None:
                    ids = with_bos(tok, ids.astype(np.int64))  # type: ignore[arg-type]
                sink.add(ids, end=False)
                last[0] = int(ids[-1])
            if end and last[0] is not None:
                close = document_end(tok, last=last[0])  # type: ignore[arg-type]
                sink.add(np.asarray(close, dtype=np.int64), end=True)
                last[0] = None
        texts.clear()
        ends.clear()

    chars = 0
    for text, end in texts_of(job):
        texts.append(text)
        ends.append(end)
        chars += len(text)
        if chars >= BATCH_CHARS:
            flush()
            chars = 0
    flush()


def texts_of(job: Job) -> Iterator[tuple[str, bool]]:
    """(text, ends a document) of the unit, long documents in parts."""
    cfg = job.cfg
    for piece in job.pieces:
        source = job.sources[piece.source]
        if source.kind == "text":
            text = text_piece(source, piece, allow_binary=cfg.allow_binary)
            yield from _split_long(text, ends=piece.ends_document)
        elif source.kind in ("parquet", "arrow"):
            for text in _table_texts(source, piece, field_name=cfg.text_field):
                yield from _split_long(text, ends=True)
        else:
            records = Records(source, piece)
            for i, record in records:
                yield from _split_long(
                    _record_text(record, where=records.where, i=i, cfg=cfg), ends=True
                )


def _split_long(text: str, *, ends: bool) -> Iterator[tuple[str, bool]]:
    """``text`` in parts of about PIECE_CHARS, each cut after a newline that ends a run
    of whitespace (where tokenizers' pre-tokenizers split anyway)."""
    lo = 0
    while len(text) - lo > PIECE_CHARS:
        cut = lo + PIECE_CHARS
        while cut < len(text) and not (text[cut - 1] == "\n" and not text[cut].isspace()):
            cut = text.find("\n", cut) + 1 or len(text)
        yield text[lo:cut], ends and cut == len(text)
        lo = cut
    if lo < len(text) or not text:
        yield text[lo:], ends


def _record_text(record: Any, *, where: Any, i: int, cfg: DataConfig) -> str:
    text = record.get(cfg.text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        present = ", ".join(map(repr, record)) if isinstance(record, dict) else "none"
        raise DataError(
            f"{where(i)}: the record has no string field {cfg.text_field!r} (fields "
            f"present: {present}). Set data.text_field to the field that holds the text, "
            "or fix that row; records are never trained as their JSON."
        )
    return text


def _table_texts(source: Source, piece: Piece, *, field_name: str) -> Iterator[str]:
    columns = table_columns(source)
    if field_name not in columns:
        raise DataError(
            f"{source.path}: no column {field_name!r} (columns: {', '.join(columns)}). Set "
            "data.text_field to the column that holds the text."
        )
    row = piece.row_base
    for batch in table_batches(source, piece, columns=[field_name]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise DataError(f"{source.path}: row {row}: {field_name!r} is not a string.")
            row += 1
            yield text


class _Where:
    """``file:line`` of a record, worked out only when an error message prints it."""

    def __init__(self, records: Records, i: int) -> None:
        self.records, self.i = records, i

    def __str__(self) -> str:
        return self.records.where(self.i)


def _conversations(
    sources: list[Source], pieces: list[Piece], *, cfg: DataConfig
) -> Iterator[tuple[Conversation, object]]:
    columns = parse_columns(cfg.columns)
    for piece in pieces:
        source = sources[piece.source]
        if not source.records:
            raise DataError(
                f"{source.path} is a plain-text file among SFT records; SFT data is rows "
                "(jsonl, json, parquet, Arrow). Keep text in a source of its own (data.mix "
                "cannot mix them either: train it in a separate run)."
            )
        records = Records(source, piece)
        for i, record in records:
            where = _Where(records, i)
            renamed = rename(record, columns)
            yield _conversation(renamed, where=where, cfg=cfg), where


def _conversation(record: Any, *, where: object, cfg: DataConfig) -> Conversation:
    """The record as an SFT example of data.schema (or of the schema it matches)."""
    if cfg.schema != "auto":
        need = REQUIRED[cfg.schema]
        if not isinstance(record, dict) or not all(k in record for k in need):
            keys = ", ".join(map(repr, record)) if isinstance(record, dict) else "none"
            raise DataError(
                f"{where}: data.schema = {cfg.schema!r} needs the key(s) {', '.join(need)}; "
                f"this record has {keys}. Map columns with data.columns, or fix the row."
            )
        return conversation(record, schema=cfg.schema, where=where)
    schema = detect(record, text_field=cfg.text_field)
    if schema is None or schema == "text":
        raise _not_sft(record, where=where, cfg=cfg, text=schema == "text")
    return conversation(record, schema=schema, where=where)


def _not_sft(record: Any, *, where: object, cfg: DataConfig, text: bool) -> DataError:
    if not text:
        return no_schema(record, where, text_field=cfg.text_field)
    return DataError(
        f"{where}: a plain-text record ({cfg.text_field!r}) among SFT rows. Keep text and "
        "SFT data in separate sources (data.mix), or map the columns (data.columns)."
    )


def iter_conversations(cfg: DataConfig) -> Iterator[tuple[Conversation, object]]:
    """Every SFT record of ``data.path``, normalized, in order (in-memory users)."""
    plan = plan_units(resolve_config(cfg), max_bytes=cfg.max_bytes)
    pieces = [p for unit in plan.units for p in unit]
    yield from _conversations(plan.sources, pieces, cfg=cfg)


def load_examples(cfg: DataConfig, tokenizer: Any) -> tuple[list[Example], Counter[str]]:
    """Every SFT row of ``data.path`` checked and tokenized, in file order, in memory
    (the same reading and formatting a prepare worker does)."""
    formatter = Formatter(
        tokenizer=tokenizer, tokenizer_path=cfg.tokenizer, data_path=str(cfg.path)
    )
    schemas: Counter[str] = Counter()
    examples: list[Example] = []
    for conv, where in iter_conversations(cfg):
        schemas[conv.schema] += 1
        examples += formatter.examples([conv], [where])
    if not examples:
        raise DataError(f"data.path ({cfg.path}) holds no SFT rows.")
    return examples, schemas
