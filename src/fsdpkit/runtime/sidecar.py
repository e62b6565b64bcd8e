"""Helper processes a rank starts beside itself (the vLLM rollout engine): they die
with the rank and never see its distributed environment.

[Note: sidecar processes]
A sidecar is a child of the rank process. Its lifetime follows [Note: worker
lifetime]: the sidecar calls ``bind_to_parent`` first thing (parent-death signal plus
a watchdog), so a rank that exits, crashes or is killed with SIGKILL takes it along,
and the rank stops it itself at exit (``atexit``) or when its run ends (``stop``). Its
environment is the rank's minus what would make it join the rank's job: torch's
launcher variables (RANK, WORLD_SIZE, MASTER_ADDR, ... , TORCHELASTIC_*), plus the
caller's updates. Its output goes to a log file,
whose tail explains a sidecar that died (``log_tail``).
"""

from __future__ import annotations

import atexit
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

DIST_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
DROP_PREFIXES = ("TORCHELASTIC_",)

_RUNNING: set[subprocess.Popen[bytes]] = set()


def sidecar_env(updates: Mapping[str, str], *, drop: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment without the rank's job variables and ``drop``,
    with ``updates``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in DIST_VARS and k not in drop and not k.startswith(DROP_PREFIXES)
    }
    env.update(updates)
    return env


def visible_device(index: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of this process's device ``index`` (so the
    sidecar sees the rank's own device as its device 0)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return str(index)
    return visible.split(",")[index].strip()


def start(
    argv: Sequence[str], *, env: Mapping[str, str], log: Path, pass_fds: Sequence[int]
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with stdout and stderr appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=tuple(pass_fds),
        )
    _RUNNING.add(proc)
    return proc


def stop(proc: subprocess.Popen[bytes], *, grace_s: float = 10.0) -> int | None:
    """Wait up to ``grace_s`` for ``proc`` to exit, then kill it; its exit code."""
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
    finally:
        _RUNNING.discard(proc)


def log_tail(log: Path, *, lines: int = 40) -> list[str]:
    """The last ``lines`` lines of ``log`` ([] when unreadable)."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64_000))
            return f.read().decode("utf-8", "replace").splitlines()[-lines:]
    except OSError:
        return []


@atexit.register
def _kill_running() -> None:
    for proc in list(_RUNNING):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
