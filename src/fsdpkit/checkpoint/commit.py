"""Steps 3-4 of [Note: save protocol]: each rank's file records, the marker, the rename.

Pure file-system work, no collectives: the Checkpointer gathers what ``local_records``
returns on every rank and calls ``publish`` on rank 0.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from fsdpkit.checkpoint.stepdir import (
    DCP_METADATA,
    FORMAT,
    META_FILE,
    VERSION,
    file_owner,
    file_record,
    fsync_dir,
    remove_tree,
    write_json_durably,
)
from fsdpkit.version import written_by


def local_records(
    tmp: Path, written: dict[str, dict[str, Any]], *, rank: int, world_size: int
) -> dict[str, dict[str, Any]]:
    """Size and crc32 of the files ``rank`` wrote into ``tmp`` (rank 0 also covers DCP's
    ``.metadata``), as the writer computed them while writing (``written``); a file it
    did not see, or that has another size now, is read and checksummed here instead."""
    out = {}
    for path in sorted(tmp.iterdir()):
        if file_owner(path.name, world_size=world_size) != rank or not path.is_file():
            continue
        record = written.get(path.name)
        if record is None or record["bytes"] != path.stat().st_size:
            record = file_record(path)
        out[path.name] = record
    return out


def merge(gathered: list[Any]) -> dict[str, Any]:
    """All ranks' records in one dict; OSError naming what a rank could not record."""
    errors = [g for g in gathered if not isinstance(g, dict)]
    if errors:
        raise OSError("; ".join(map(str, errors)))
    files: dict[str, Any] = {}
    for records in gathered:
        files.update(records)
    if DCP_METADATA not in files:
        raise FileNotFoundError(f"DCP wrote no {DCP_METADATA}")
    return files


def marker(
    *, step: int, world_size: int, run: dict[str, Any], state: dict[str, Any], files: dict
) -> dict[str, Any]:
    """The contents of fsdpkit.json ([Note: completion marker])."""
    now = datetime.datetime.now(datetime.UTC)
    return {
        "format": FORMAT,
        "version": VERSION,
        **written_by(),
        "step": step,
        "time": now.isoformat(timespec="seconds"),
        "unix_time": now.timestamp(),
        "world_size": world_size,
        "run": run,
        "state": state,
        "files": files,
    }


def publish(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Write the marker (fsync), rename ``tmp`` to ``final``, fsync the directory: the
    checkpoint is complete exactly when this returns."""
    write_json_durably(tmp / META_FILE, meta)
    old = final.with_name(final.name + ".old")
    if final.exists():  # saving a step again (resumed run): replace it
        remove_tree(old)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    remove_tree(old)
