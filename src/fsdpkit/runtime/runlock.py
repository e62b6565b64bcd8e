"""One run per run directory: an advisory lock that names its holder.

[Note: run-dir lock]
Two jobs writing one run dir interleave ``metrics.jsonl`` and delete each other's
checkpoints. So a run holds ``RUN_DIR/fsdpkit.lock`` for its whole life:
``fcntl.flock(LOCK_EX | LOCK_NB)`` on the open file, with the holder's host, pid,
start time and command written into it. The kernel drops a flock when its process
dies however it dies, so a lock file left behind by a dead process is simply taken
over (nothing to clean up); on NFSv4 the server drops a dead client's locks when its
lease expires. Where the file system has no locks at all (flock fails with ENOLCK or
EOPNOTSUPP) the record decides: a live process on this host with the same start time
holds it; a record from another host is trusted for ``STALE_AFTER_S`` only.

Who holds it: the spawning launcher (single node, before any worker starts); in a
joined run (torchrun, SLURM, a multi-node spawn) there is no launcher of ours, and
rank 0 takes it before writing anything. The lock file itself is never deleted (a
delete would let two processes lock two different files of the same name).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fsdpkit.errors import UserError
from fsdpkit.runtime.rundir import describe_os_error

LOCK_FILE = "fsdpkit.lock"
STALE_AFTER_S = 24 * 3600.0
"""Without file-system locks, a record from another host older than this is stale."""


class RunDirLocked(UserError):
    """Another live run holds the run directory."""


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused
    pid from the original."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str
    """ISO time the holder took the lock."""
    command: str
    proc_start: int | None = None

    @classmethod
    def me(cls) -> Holder:
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        return cls(
            socket.gethostname(),
            os.getpid(),
            now,
            " ".join(sys.argv)[:300],
            _proc_start(os.getpid()),
        )

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started} ({self.command})"

    def alive(self) -> bool:
        """Whether the holder still runs (decidable only on this host)."""
        if self.host != socket.gethostname():
            try:
                started = datetime.datetime.fromisoformat(self.started).timestamp()
            except ValueError:
                return False
            return time.time() - started < STALE_AFTER_S
        start = _proc_start(self.pid)
        return start is not None and (self.proc_start is None or start == self.proc_start)


def _read_holder(f: IO[str]) -> Holder | None:
    f.seek(0)
    try:
        data: Any = json.loads(f.read() or "null")
        return Holder(**data) if isinstance(data, dict) else None
    except (ValueError, TypeError):
        return None


class RunLock:
    """The held lock of one run dir; ``release()`` or process exit frees it."""

    def __init__(self, path: Path, handle: IO[str]) -> None:
        self.path = path
        self._handle: IO[str] | None = handle

    def release(self) -> None:
        """Clear the record and unlock (idempotent)."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            handle.seek(0)
            handle.truncate()
            handle.flush()
        except OSError:
            pass
        handle.close()  # closing the file drops the flock

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _refusal(run_dir: Path, holder: Holder | None) -> RunDirLocked:
    who = holder.describe() if holder else "a process that left no record"
    return RunDirLocked(
        f"logging.run_dir = {run_dir} is in use by another run: {who}. Two runs in one "
        "directory would mix their metrics and delete each other's checkpoints. Wait for "
        "that run to finish (or stop it), or give this run another logging.run_dir. If that "
        f"process is really gone (e.g. its host died), delete {run_dir / LOCK_FILE}."
    )


def _try_flock(handle: IO[str]) -> bool | None:
    """True: locked; False: held by another process; None: no locks on this file system."""
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return None
        raise


def acquire(run_dir: Path) -> RunLock:
    """Lock ``run_dir`` for this process ([Note: run-dir lock]); RunDirLocked naming the
    holder if a live run has it; RunDirError-style UserError if the file cannot be
    written."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    try:
        handle = open(path, "a+")  # noqa: SIM115 (held for the run's life)
    except OSError as exc:
        raise UserError(
            f"cannot create the run lock {path}: {describe_os_error(exc)}. Point "
            "logging.run_dir at a writable directory."
        ) from None
    try:
        locked = _try_flock(handle)
        holder = _read_holder(handle)
        if locked is False or (locked is None and holder is not None and holder.alive()):
            raise _refusal(run_dir, holder)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(Holder.me().__dict__) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    except OSError as exc:
        handle.close()
        raise UserError(
            f"cannot write the run lock {path}: {describe_os_error(exc)}. Point "
            "logging.run_dir at a writable directory with free space."
        ) from None
    except BaseException:
        handle.close()
        raise
    return RunLock(path, handle)
