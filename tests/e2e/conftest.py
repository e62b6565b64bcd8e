"""Fixtures shared by the CLI tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator

import pytest
from clirun import children


@pytest.fixture
def launched() -> Iterator[list[subprocess.Popen[str]]]:
    """Launchers a test started (``clirun.start``); killed with their process group
    and their workers' if the test leaves them running."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            for pid in children(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
