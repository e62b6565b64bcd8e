"""A killed launcher's control directory is removed by the next launch, a live one's
is not ([Note: control directory])."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from fsdpkit.runtime.controldir import HELD, PREFIX, control_dir, sweep_orphans

_KILLED = """
import os, signal, sys
from pathlib import Path
from fsdpkit.runtime.controldir import control_dir
ctx = control_dir(root=Path(sys.argv[1]))
path = ctx.__enter__()
(path / "progress-rank-0").write_text("step 3")
print(path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_launcher_dir(root: Path) -> Path:
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED, str(root)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return Path(proc.stdout.strip())


def test_a_killed_launchers_directory_is_swept_and_a_live_one_is_kept(tmp_path: Path) -> None:
    orphan = _killed_launcher_dir(tmp_path)
    assert (orphan / HELD).exists() and (orphan / "progress-rank-0").exists()
    older = tmp_path / f"{PREFIX}old_format"  # an older fsdpkit's: no lock file, kept
    older.mkdir()
    with control_dir(root=tmp_path) as live:  # sweeps first
        assert not orphan.exists()
        assert live.is_dir() and (live / HELD).exists()
        assert sweep_orphans(root=tmp_path) == []  # the live launcher holds its lock
        assert live.is_dir() and older.is_dir()
    assert not live.exists()
    assert older.is_dir()


def test_each_launch_sweeps_the_orphans_before_it_once(tmp_path: Path) -> None:
    first = _killed_launcher_dir(tmp_path)
    second = _killed_launcher_dir(tmp_path)  # its launch removed the first
    assert not first.exists() and second.is_dir()
    assert sweep_orphans(root=tmp_path) == [second]
    assert sweep_orphans(root=tmp_path) == []
    assert list(tmp_path.iterdir()) == []
