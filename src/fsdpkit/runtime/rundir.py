"""The run directory as a place to write: checked before any process starts, every
file written whole, file-system faults reported as the user's to fix.

[Note: run-dir faults]
A run dir that is a regular file, sits on a read-only file system or is not
writable is refused by ``check_run_dir`` in the launcher, before any worker starts
(one paragraph, exit 2). Faults that appear later (disk full, a file system
remounted read-only, I/O errors) while writing ``config.toml`` or ``metrics.jsonl``
raise ``RunDirError`` naming the file and the cause. Writers never leave half a
record: ``config.toml`` is written to a temporary name and renamed; a metrics line
is appended in one ``write`` and, if that fails part-way, the file is cut back to
its previous length. Readers (``read_jsonl``) still skip a torn last line, which a
killed writer (or a failed cut) can leave.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from fsdpkit.errors import UserError

_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "an I/O error (a failing disk or network file system)",
    errno.EFBIG: "the file-size limit (ulimit -f) is reached",
    errno.ENOTDIR: "a component of the path is a regular file, not a directory",
    errno.EISDIR: "a directory stands where a file should be",
}


class RunDirError(UserError):
    """The run directory cannot be used or written; the message names the path, the
    cause and the fix."""


def describe_os_error(exc: OSError) -> str:
    """What an OSError means for a user, in a few words (``the disk is full``)."""
    cause = _CAUSES.get(exc.errno or 0)
    detail = exc.strerror or str(exc)
    return f"{cause} ({detail})" if cause else detail


_FIX = (
    "Point logging.run_dir at a writable directory with free space (or free space, fix "
    "the permissions or remount the file system read-write)"
)


def check_run_dir(path: Path) -> None:
    """Refuse a run dir training cannot write ([Note: run-dir faults]); creates it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(
            f"logging.run_dir = {path} is a regular file, not a directory: the run writes "
            "config.toml, metrics.jsonl and checkpoints/ inside it. Point logging.run_dir at "
            "a directory (it is created if missing), or move that file away."
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(
            f"logging.run_dir = {path} cannot be created: {describe_os_error(exc)}. {_FIX}."
        ) from None
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".fsdpkit-write-test-")
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise RunDirError(
            f"logging.run_dir = {path} is not writable: {describe_os_error(exc)}. {_FIX}."
        ) from None


def write_text_atomically(path: Path, text: str, *, what: str) -> None:
    """Write ``text`` to ``path`` via a temporary name and a rename (a reader sees the
    old file or the new one, never half); RunDirError on any OS error."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise RunDirError(
            f"cannot write {what} {path}: {describe_os_error(exc)}. {_FIX}."
        ) from None


def append_line(path: Path, record: dict[str, Any], *, what: str) -> None:
    """Append ``record`` as one JSON line in a single write; on failure cut the file
    back to its previous length (no torn line) and raise RunDirError."""
    data = (json.dumps(record) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RunDirError(f"cannot open {what} {path}: {describe_os_error(exc)}. {_FIX}.") from None
    try:
        size = os.fstat(fd).st_size
        try:
            rest = memoryview(data)
            while rest:  # a short write is retried: the retry reports the real errno
                rest = rest[os.write(fd, rest) :]
        except OSError as exc:
            _cut(fd, size)
            raise RunDirError(
                f"cannot append to {what} {path}: {describe_os_error(exc)}. {_FIX}."
            ) from None
    finally:
        os.close(fd)


def _cut(fd: int, size: int) -> None:
    """Best effort: drop a partial record (readers skip a torn last line anyway)."""
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size > size:
            os.ftruncate(fd, size)
    except OSError:
        pass


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a torn or non-object line (a killed writer's
    last) is skipped, never an error."""
    records = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
