"""One run per run dir (fsdpkit.runtime.runlock): the lock, its record, a stale record."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from fsdpkit.runtime.runlock import LOCK_FILE, RunDirLocked, acquire


def test_one_run_per_run_dir(tmp_path: Path) -> None:
    with acquire(tmp_path):
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        with pytest.raises(RunDirLocked) as e:
            acquire(tmp_path)  # another open file description: flock refuses it
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in str(e.value)
    stale = {**record, "pid": 2**22 + 7, "proc_start": 1}  # a dead process's record
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale))
    with acquire(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # released: record cleared
