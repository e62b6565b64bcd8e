"""What is in a checkpoint, and which checkpoints a run has: data for ``fsdpkit ckpt``.

These functions compute; the CLI formats.
"""

from __future__ import annotations

import datetime
from collections import Counter
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.statefuls import model_prefix
from fsdpkit.checkpoint.stepdir import Entry, list_entries, read_meta
from fsdpkit.checkpoint.untrusted import read_metadata


def _section(key: str, prefix: str | None) -> str:
    if prefix and key.startswith(prefix):
        return "model"
    if prefix and key.startswith(prefix.removesuffix("model.") + "optim."):
        return "optimizer"
    return "other"


def inspect_checkpoint(ckpt: Path, *, top: int = 10) -> dict[str, Any]:
    """Step, saved world size/mesh/strategy, tensor counts and bytes (by dtype and by
    model/optimizer/other), and the largest tensors. JSON-able. ``.metadata`` is read
    only after its checksum matches, with the restricted unpickler
    ([Note: untrusted checkpoints])."""
    meta = read_meta(ckpt)
    md = read_metadata(Path(ckpt), meta)
    tensors = {
        k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
    }
    prefix = _safe_prefix(meta, list(tensors))
    by_dtype: Counter[str] = Counter()
    by_section: Counter[str] = Counter()
    sizes = []
    for key, t in tensors.items():
        nbytes = t.size.numel() * t.properties.dtype.itemsize
        by_dtype[str(t.properties.dtype).removeprefix("torch.")] += nbytes
        by_section[_section(key, prefix)] += nbytes
        sizes.append((nbytes, key, list(t.size), str(t.properties.dtype).removeprefix("torch.")))
    sizes.sort(reverse=True)
    run = meta.get("run", {})
    return {
        "path": str(ckpt),
        "step": meta["step"],
        "time": meta.get("time"),
        "world_size": meta.get("world_size"),
        "format_version": meta.get("version"),
        "fsdpkit_version": meta.get("fsdpkit_version"),
        "torch_version": meta.get("torch_version"),
        "mesh": run.get("mesh"),
        "strategy": run.get("strategy"),
        "tensors": len(tensors),
        "objects": sum(
            isinstance(v, BytesStorageMetadata) for v in md.state_dict_metadata.values()
        ),
        "tensor_bytes": sum(by_dtype.values()),
        "file_bytes": sum(int(r["bytes"]) for r in meta.get("files", {}).values()),
        "bytes_by_dtype": dict(by_dtype),
        "bytes_by_section": dict(by_section),
        "largest": [{"name": k, "shape": s, "dtype": d, "bytes": b} for b, k, s, d in sizes[:top]],
    }


def _safe_prefix(meta: dict[str, Any], keys: list[str]) -> str | None:
    try:
        return model_prefix(meta, keys)
    except Exception:
        return None


def list_run(run_dir: Path) -> list[dict[str, Any]]:
    """Every checkpoint directory of a run: step, time, size and ``state`` (complete,
    incomplete, or unreadable: a marker that cannot be read, with ``problem``). One bad
    checkpoint never hides the others."""
    return [_row(entry) for entry in list_entries(run_dir)]


def _row(entry: Entry) -> dict[str, Any]:
    row: dict[str, Any] = {"step": entry.step, "path": str(entry.path), "time": None}
    row["state"] = "complete" if entry.complete else "incomplete"
    if entry.complete:
        try:
            row["time"] = read_meta(entry.path).get("time")
        except CheckpointError as exc:
            row |= {"state": "unreadable", "problem": str(exc)}
    try:
        if row["time"] is None:
            mtime = entry.path.stat().st_mtime
            stamp = datetime.datetime.fromtimestamp(mtime, datetime.UTC)
            row["time"] = stamp.isoformat(timespec="seconds")
        row["bytes"] = entry.size_bytes()
    except OSError as exc:
        row |= {"bytes": None, "state": "unreadable", "problem": f"{entry.path}: {exc}"}
    row["complete"] = row["state"] == "complete"
    return row
