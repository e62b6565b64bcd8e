"""What the planner, the doctor and ``fsdpkit data inspect`` ask of the data.

- ``inspect_dataset(path)``: a prepared dataset's summary and its problems (a missing
  or torn shard, a size that disagrees with the manifest, a bad manifest; with
  ``verify``, every shard file's crc32; sources changed since it was prepared);
- ``check_tokenizer(manifest, tokenizer_dir)``: a DataError naming both when a
  tokenizer is not the one the dataset was made with;
- ``host_bytes(cfg)``: host memory one rank's data path holds while training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpkit.config import DataConfig
from fsdpkit.data.cache import cache_root
from fsdpkit.data.errors import DataError
from fsdpkit.data.manifest import Manifest, crc32, is_dataset
from fsdpkit.data.sft import describe_schemas
from fsdpkit.data.tokcheck import check_tokenizer as _check

__all__ = ["DatasetInfo", "check_tokenizer", "host_bytes", "inspect_dataset"]

ROW_BYTES = 24
"""SFT layout per row in memory: start, length, answer count (int64 each)."""
EXAMPLE_BYTES = 24
"""SFT per example, only while the layout is built at start-up (freed after)."""
FIXED_BYTES = 4 << 20
"""Loader objects, shard maps, one step's index arithmetic: a small constant."""
SFT_BYTES_PER_EXAMPLE = 200
"""Source bytes per SFT example assumed before a dataset is prepared (an upper bound
on the example count for typical chat data)."""


@dataclass
class DatasetInfo:
    """A prepared dataset at a glance, and everything wrong with it."""

    path: Path
    manifest: Manifest | None
    problems: list[str] = field(default_factory=list)
    """What makes it unusable (a run refuses it)."""
    warnings: list[str] = field(default_factory=list)
    """What changed since (sources edited or gone): the dataset itself is intact."""
    disk_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not self.problems

    def summary(self) -> dict[str, Any]:
        """The manifest's counts and identity as plain values (``--json``, the doctor)."""
        m = self.manifest
        if m is None:
            return {"path": str(self.path), "ok": False, "problems": self.problems}
        return {
            "path": str(self.path),
            "ok": self.ok,
            "kind": m.kind,
            "schemas": m.schemas,
            "counts": m.counts,
            "dtype": m.dtype,
            "tokenizer": m.tokenizer,
            "shards": len(m.shards),
            "sources": len(m.sources),
            "disk_bytes": self.disk_bytes,
            "created": m.created,
            "fsdpkit_version": m.fsdpkit_version,
            "options": m.options,
            "problems": self.problems,
            "warnings": self.warnings,
        }

    def describe(self) -> list[str]:
        m = self.manifest
        if m is None:
            return [f"{self.path}: not a prepared dataset"]
        c = m.counts
        kind = f"SFT: {describe_schemas(m.schemas)}" if m.sft else "plain text"
        tok = m.tokenizer
        tok_name = "byte-level" if tok.get("kind") == "byte" else f"{tok.get('path')}"
        return [
            f"dataset      {self.path}  ({'ok' if self.ok else 'DAMAGED'})",
            f"kind         {kind}",
            f"documents    {c['documents']:,}",
            f"tokens       {c['tokens']:,} ({m.dtype})"
            + (f", {c['answer_tokens']:,} answer tokens" if m.sft else ""),
            f"tokenizer    {tok_name} (vocab {tok.get('vocab_size')}, {tok.get('fingerprint')})",
            f"sources      {len(m.sources):,} file(s), {c['source_bytes'] / 1e6:,.1f} MB"
            + (
                f" ({c['left_out_bytes']:,} bytes left out by max_bytes)"
                if c.get("left_out_bytes")
                else ""
            ),
            f"shards       {len(m.shards):,}, {self.disk_bytes / 1e6:,.1f} MB on disk",
            f"made         {m.created} by fsdpkit {m.fsdpkit_version}",
        ]


def _crc_file(path: Path) -> str:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = crc32(chunk, crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def inspect_dataset(
    path: str | Path, *, verify: bool = False, sources: bool = False
) -> DatasetInfo:
    """Summary and problems of the dataset at ``path`` (``verify``: recompute crc32s;
    ``sources``: report sources changed since the prepare)."""
    root = Path(path).expanduser()
    info = DatasetInfo(path=root, manifest=None)
    try:
        info.manifest = Manifest.read(root)
    except DataError as exc:
        info.problems.append(str(exc))
        return info
    m = info.manifest
    info.problems += m.problems(root)
    for shard in m.shards:
        for suffix, file in shard.files(root, sft=m.sft).items():
            if file.is_file():
                info.disk_bytes += file.stat().st_size
                if verify and shard.crc32.get(suffix) not in (None, _crc_file(file)):
                    info.problems.append(f"{file.name}: crc32 differs from the manifest (corrupt)")
    if sources:
        for s in m.sources:
            p = Path(s["path"])
            if not p.is_file():
                info.warnings.append(f"source {p} no longer exists (the dataset is intact)")
            elif p.stat().st_size != s["size"]:
                info.warnings.append(f"source {p} changed size since the prepare")
    return info


def check_tokenizer(
    manifest: Manifest, tokenizer_dir: str | Path | None, *, root: Path | None = None
) -> None:
    """A DataError naming both tokenizers when ``tokenizer_dir`` (None: byte-level) is
    not the one ``manifest``'s dataset was prepared with."""
    _check(manifest, tokenizer_dir, root=root or Path("(dataset)"))


def _manifest_for(cfg: DataConfig, work_dir: Path | None) -> Manifest | None:
    if cfg.path and is_dataset(Path(cfg.path).expanduser()):
        return Manifest.read(Path(cfg.path).expanduser())
    if work_dir is not None and is_dataset(cache_root(cfg, work_dir) / "train"):
        return Manifest.read(cache_root(cfg, work_dir) / "train")
    return None


def host_bytes(cfg: DataConfig, *, micro_batch: int = 1, work_dir: Path | None = None) -> int:
    """Host memory one rank's data path holds while training (not the page cache of the
    mapped shards, which the kernel reclaims): a constant plus one step's micro-batch,
    and for SFT the row layout (``ROW_BYTES`` per row, at most one row per example; the
    layout is built with ``EXAMPLE_BYTES`` per example, freed before training).
    Plain text holds nothing per token or sequence, whatever the corpus size. Before a
    raw source is prepared, SFT examples are estimated from its size."""
    batch = micro_batch * (cfg.seq_len + 1) * 8 * 4
    manifest = _manifest_for(cfg, work_dir)
    if manifest is not None:
        if not manifest.sft:
            return FIXED_BYTES + batch + 64 * len(manifest.shards)
        return FIXED_BYTES + batch + manifest.counts["documents"] * ROW_BYTES
    if cfg.format == "text" or cfg.schema == "text" or not (cfg.path or cfg.mix):
        return FIXED_BYTES + batch
    paths = [p.rpartition("@")[0] or p for p in cfg.mix] if cfg.mix else [cfg.path or ""]
    size = sum(_size(Path(p).expanduser()) for p in paths)
    return FIXED_BYTES + batch + size // SFT_BYTES_PER_EXAMPLE * ROW_BYTES


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return 0
