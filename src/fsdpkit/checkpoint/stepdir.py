"""On-disk layout of a run's checkpoints, the completion marker, checksums and verify.

    RUN_DIR/checkpoints/
        step-00000100/          complete: DCP files + fsdpkit.json
            .metadata           DCP's index (a pickle: read only after its crc32 matches,
                                with a restricted unpickler; see checkpoint.untrusted)
            __0_0.distcp ...    one data file per rank (any world size can read them)
            fsdpkit.json        written LAST: step, world size, run facts, per-file size
                                and crc32 (.metadata's included)
        step-00000200.tmp/      a save in progress, or one that crashed (never loaded)

[Note: completion marker]
A checkpoint is complete iff its directory is named exactly ``step-NNNNNNNN`` and holds
``fsdpkit.json``. Saves write into ``step-NNNNNNNN.tmp``, write ``fsdpkit.json`` only
after every rank's data and DCP's ``.metadata`` are on disk (fsync'ed), then rename the
directory. Anything else under ``checkpoints/`` is partial: listed, never resumed from,
and removed by retention after the next successful save.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpkit.checkpoint.checksum import crc32_file
from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.untrusted import DCP_METADATA, read_metadata
from fsdpkit.version import __version__

META_FILE = "fsdpkit.json"
FORMAT = "fsdpkit-checkpoint"
VERSION = 1
_NAME = re.compile(r"^step-(\d{8,})(\..+)?$")
RANK_FILE = re.compile(r"^__(\d+)_")
"""DCP's data files are ``__<rank>_<i>.distcp``."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "crc32": crc32_file(path)}


def fsync_dir(path: Path) -> None:
    """Make a rename or new file in ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_durably(path: Path, data: dict[str, Any]) -> None:
    """Write via a temporary name, fsync, rename: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_meta(ckpt: Path) -> dict[str, Any]:
    """The completion marker's contents; CheckpointError if absent or unreadable."""
    meta_path = Path(ckpt) / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(
            f"{ckpt} is not a complete fsdpkit checkpoint: {META_FILE} is missing (the save "
            "did not finish, or this is not a checkpoint directory). Pick a complete one "
            "from `fsdpkit ckpt list RUN_DIR`, or use checkpoint.resume=auto."
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{meta_path} cannot be read ({exc}); the checkpoint is damaged. Pick another "
            "one from `fsdpkit ckpt list RUN_DIR`."
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not _well_formed(meta):
        raise CheckpointError(
            f"{meta_path} is not a valid fsdpkit checkpoint marker (needs an integer step "
            "and a size and crc32 per file); the checkpoint is damaged or was not written "
            "by fsdpkit. Pick another one from `fsdpkit ckpt list RUN_DIR`."
        )
    _check_version(meta_path, meta)
    return meta


def _check_version(meta_path: Path, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint format this fsdpkit does not know (docs/compatibility.md): a
    newer format would be misread, not read."""
    version = meta.get("version")
    if version == VERSION:
        return
    writer = meta.get("fsdpkit_version")
    by = f"fsdpkit {writer}" if writer else "an fsdpkit that did not record its version"
    raise CheckpointError(
        f"{meta_path} is checkpoint format version {version!r}, written by {by}; this "
        f"fsdpkit ({__version__}) reads format {VERSION} only. Resume or export it with "
        "the fsdpkit that wrote it (`pip install fsdpkit==X.Y.Z`), or see "
        "docs/compatibility.md for which releases read which formats."
    )


def _well_formed(meta: dict[str, Any]) -> bool:
    files = meta.get("files", {})
    return (
        isinstance(meta.get("step"), int)
        and isinstance(files, dict)
        and all(
            isinstance(r, dict)
            and isinstance(r.get("bytes"), int)
            and isinstance(r.get("crc32"), str)
            and "/" not in name
            and name not in (".", "..")
            for name, r in files.items()
        )
    )


@dataclass(frozen=True)
class Entry:
    """One directory under ``checkpoints/``."""

    step: int
    path: Path
    complete: bool
    """See [Note: completion marker]."""

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())


def list_entries(root: Path) -> list[Entry]:
    """Checkpoint directories under ``root`` (a run dir or its checkpoints/), oldest first."""
    root = Path(root)
    if (root / "checkpoints").is_dir():
        root = root / "checkpoints"
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _NAME.match(child.name)
        if m and child.is_dir():
            complete = m.group(2) is None and (child / META_FILE).is_file()
            out.append(Entry(step=int(m.group(1)), path=child, complete=complete))
    return sorted(out, key=lambda e: (e.step, e.complete, e.path.name))


def complete_entries(root: Path) -> list[Entry]:
    return [e for e in list_entries(root) if e.complete]


@dataclass
class VerifyReport:
    """What ``verify`` found; ``problems`` name each bad file and how it is bad."""

    path: Path
    step: int | None = None
    files: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        if self.ok:
            return f"{self.path}: OK (step {self.step}, {self.files} files, {self.bytes} bytes)"
        return f"{self.path}: CORRUPT: " + "; ".join(self.problems)


def _check_file(path: Path, record: dict[str, Any], *, checksums: bool) -> str | None:
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size < record["bytes"]:
        return f"{path.name} is truncated ({size} of {record['bytes']} bytes)"
    if size != record["bytes"]:
        return f"{path.name} has the wrong size ({size} bytes, expected {record['bytes']})"
    if checksums and (crc := crc32_file(path)) != record["crc32"]:
        return f"{path.name} is corrupt (crc32 {crc}, expected {record['crc32']})"
    return None


def file_owner(name: str, *, world_size: int) -> int:
    """The rank that checksums ``name``: rank r's data files go to r mod world size
    (each rank re-reads what it wrote, or roughly what it will load), the rest to 0."""
    m = RANK_FILE.match(name)
    return int(m.group(1)) % world_size if m else 0


def verify(
    ckpt: Path,
    *,
    checksums: bool = True,
    share: tuple[int, int] | None = None,
    metadata: bool = False,
) -> VerifyReport:
    """Check every file recorded in the marker: present, right size, right crc32.

    ``checksums=False`` checks presence and sizes only (fast). ``share=(rank, world)``
    checks only the files ``file_owner`` gives this rank, so ranks verify in parallel.
    ``metadata=True`` also parses ``.metadata`` with the restricted unpickler: it must be
    DCP metadata and nothing else ([Note: untrusted checkpoints])."""
    report = VerifyReport(path=Path(ckpt))
    try:
        meta = read_meta(ckpt)
    except CheckpointError as exc:
        report.problems.append(str(exc))
        return report
    report.step = int(meta["step"])
    files: dict[str, Any] = meta.get("files") or {}
    for name, record in sorted(files.items()):
        if share is not None and file_owner(name, world_size=share[1]) != share[0]:
            continue
        report.files += 1
        report.bytes += int(record["bytes"])
        problem = _check_file(Path(ckpt) / name, record, checksums=checksums)
        if problem:
            report.problems.append(problem)
    if share is None or share[0] == 0:
        if DCP_METADATA not in files:
            report.problems.append(f"{META_FILE} lists no {DCP_METADATA} file")
        elif metadata and not any(p.startswith(f"{DCP_METADATA} ") for p in report.problems):
            try:
                read_metadata(Path(ckpt), meta)
            except CheckpointError as exc:
                report.problems.append(str(exc))
    return report


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: single-process use
    (offline tools, scripts without ``init_process_group``) is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def remove_tree(path: Path) -> None:
    """Delete a checkpoint directory; a concurrent reader on NFS may hold files open."""
    shutil.rmtree(path, ignore_errors=True)
