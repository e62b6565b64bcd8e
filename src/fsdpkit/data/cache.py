"""Raw ``data.path`` sources prepared once per node into the run's cache, others wait.

Every rank opens its data before the process group exists, so there is no collective
to elect a preparer. Instead the ranks take an exclusive ``fcntl`` lock on
``CACHE/.prepare.lock`` one after the other: the first finds no dataset (or one made
from other inputs) and prepares it (atomically, [Note: prepare protocol]); each later
one finds it complete and identical, which costs a ``stat`` per source. A rank whose
holder dies gets the lock (the kernel drops it with the process) and prepares itself;
bad data fails every rank with the same error.
"""

from __future__ import annotations

import fcntl
import time
from pathlib import Path
from typing import Any

from fsdpkit.config import DataConfig
from fsdpkit.data.errors import DataError
from fsdpkit.data.manifest import is_dataset
from fsdpkit.data.prepare import Prepared, prepare

LOCK = ".prepare.lock"
POLL_S = 0.5
SAY_AFTER_S = 5.0
"""A wait shorter than this goes unsaid (a small cache is ready in well under it)."""


def cache_root(cfg: DataConfig, work_dir: Path) -> Path:
    """``data.cache_dir``, else ``RUN_DIR/data``."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else work_dir / "data"


class PrepareLock:
    """An exclusive lock on a cache directory; says once that it waits."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._file: Any = None

    def __enter__(self) -> PrepareLock:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._file = (self.root / LOCK).open("a+")
        except OSError as exc:
            raise DataError(
                f"cannot create the data cache {self.root} ({exc.strerror or exc}); set "
                "data.cache_dir (or logging.run_dir) to a writable directory."
            ) from exc
        told, start = False, time.monotonic()
        while True:
            try:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:  # progress, not an error: stdout, and only if it lasts
                if not told and time.monotonic() - start >= SAY_AFTER_S:
                    print(f"data: waiting for another rank preparing {self.root}", flush=True)
                    told = True
                time.sleep(POLL_S)

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()


def prepared(cfg: DataConfig, *, work_dir: Path, name: str, progress: bool = True) -> Prepared:
    """The dataset of ``cfg``'s raw sources in the cache (prepared here if needed)."""
    root = cache_root(cfg, work_dir)
    out = root / name
    with PrepareLock(root):
        stale = is_dataset(out)
        result = prepare(cfg, out, rebuild=True, progress=progress)
    if stale and not result.reused:
        print(f"data: the sources or settings changed since {out} was prepared: rebuilt")
    return result
