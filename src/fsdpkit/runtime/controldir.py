"""The spawning launcher's control directory, and those that killed launchers left behind.

[Note: control directory]
A spawning launcher gives its workers a private directory in the system's temp
directory (``$FSDPKIT_ERROR_DIR``: their error records, progress files and stack
dumps) and removes it when it returns. A launcher killed by SIGKILL or the OOM killer
cannot remove it: its workers die with it ([Note: worker lifetime]), but the directory
stayed in /tmp, one per killed run. So the launcher holds a flock on ``HELD`` inside
its directory for its whole life, and every launch first removes the control
directories whose lock it can take: the kernel drops a flock when its process dies,
however it dies, so a lock that can be taken means no launcher is left to use the
directory. No pid is compared, so launchers in other pid namespaces sharing /tmp are
safe. The lock file is created under another name, locked, then renamed into place,
so a directory is never seen with an unheld ``HELD``. Directories without ``HELD``
(made by an older fsdpkit, or by a launcher killed while starting) are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

PREFIX = "fsdpkit-control-"
HELD = "launcher.lock"


def _try_lock(fd: int) -> bool:
    """True when this process now holds the flock on ``fd``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def sweep_orphans(*, root: Path | None = None) -> list[Path]:
    """Remove the control directories under ``root`` (the temp directory) whose
    launcher is gone ([Note: control directory]); returns what was removed."""
    removed = []
    for path in sorted(Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*")):
        try:
            fd = os.open(path / HELD, os.O_RDONLY)
        except OSError:  # not ours to judge, or already removed
            continue
        try:
            if _try_lock(fd):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        except OSError:  # a file system without locks: leave it alone
            pass
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def control_dir(*, root: Path | None = None) -> Iterator[Path]:
    """A fresh control directory, held for the ``with`` block and removed after it;
    orphans of killed launchers are swept first ([Note: control directory])."""
    sweep_orphans(root=root)
    path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
    fd = os.open(path / f".{HELD}", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):  # without locks the directory is just not swept
            _try_lock(fd)
            os.rename(path / f".{HELD}", path / HELD)
        yield path
    finally:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
