"""Make the shared test support and examples/tiny_hf.py (tiny HF configs, models and
tokenizers, the README example's own module) importable (also in spawned ranks, which
inherit sys.path; CLI subprocesses get both on PYTHONPATH from e2e/clirun.py), and fail
the suite if any process the tests started outlives it.

Every process the suite starts inherits ``FSDPKIT_TEST_SESSION`` (set here, unique
per pytest run), so leftovers are found by that marker in ``/proc/PID/environ`` and
never confused with other users' processes on a shared machine. At the end of the
session, processes still carrying it after a grace period are listed, killed and
the run fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parents[1] / "examples"))

MARKER = "FSDPKIT_TEST_SESSION"
os.environ[MARKER] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
GRACE_S = 15.0
"""Time left to processes that are already exiting (e.g. a killed run's workers)."""
_EXEMPT = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Helpers of pytest itself that live exactly as long as it does."""


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def marked_processes() -> list[int]:
    """Live processes (other than this one) started by this test session."""
    token = f"{MARKER}={os.environ[MARKER]}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if token in environ.split(b"\0") and not any(e in _cmdline(int(entry)) for e in _EXEMPT):
            found.append(int(entry))
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not os.path.isdir("/proc"):
        return
    deadline = time.monotonic() + GRACE_S
    left = marked_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = marked_processes()
    if not left:
        return
    lines = [f"  pid {pid}: {_cmdline(pid)[:200]}" for pid in left]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    text = "processes started by the tests were still running (now killed):\n" + "\n".join(lines)
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(text, red=True)
    else:
        print(text, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
