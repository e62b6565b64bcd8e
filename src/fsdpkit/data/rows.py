"""The rows of ``data.path`` themselves, for objectives that read rows rather than
prepared token shards (preference pairs, RL prompts): every record in file order, renamed
by ``data.columns``, with where it came from, through the readers every other run uses
(jsonl, compressed jsonl, json, parquet, Arrow from ``datasets.save_to_disk``, Hugging
Face dataset directories; fsdpkit.data.sources)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fsdpkit.config import DataConfig
from fsdpkit.data.errors import DataError
from fsdpkit.data.manifest import is_dataset
from fsdpkit.data.plan import plan_units, resolve_config
from fsdpkit.data.readers import Records
from fsdpkit.data.schemas import parse_columns, rename


def read_rows(
    cfg: DataConfig, *, what: str, objective: str, keys: str
) -> Iterator[tuple[Any, str]]:
    """(record, where) for every row of ``data.path`` (within ``data.max_bytes``);
    ``where`` is ``file:line`` (jsonl) or ``file: row N`` / ``file: record N``. Errors
    name ``what`` the rows are for, the ``objective`` that reads them and the ``keys``
    a row holds."""
    if cfg.path and is_dataset(Path(cfg.path).expanduser()):
        raise DataError(
            f"data.path ({cfg.path}) is a dataset written by `fsdpkit data prepare`, which "
            f"holds token shards, not {what}; train.objective = {objective!r} reads the "
            "rows themselves: point data.path at the jsonl / json / parquet / Arrow files."
        )
    plan = plan_units(resolve_config(cfg), max_bytes=cfg.max_bytes)
    columns = parse_columns(cfg.columns)
    for piece in (p for unit in plan.units for p in unit):
        source = plan.sources[piece.source]
        if not source.records:
            raise DataError(
                f"{source.path} is a plain-text file; {what} are rows (jsonl, json, parquet, "
                f"Arrow) of {keys}."
            )
        records = Records(source, piece)
        for i, record in records:
            yield rename(record, columns), records.where(i)
