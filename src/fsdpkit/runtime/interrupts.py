"""The spawning launcher's side of Ctrl-C, SIGHUP, SIGTERM and SIGQUIT.

[Note: stopping a spawned run]
Workers run in sessions of their own, so a terminal's Ctrl-C or hang-up reaches only
the launcher. torch's elastic agent would forward the signal to the workers by
itself, but it re-installs its handler every time it starts workers and cannot tell
a first Ctrl-C from a second, so fsdpkit passes it no signals and installs this
handler instead (before the agent runs):

- first SIGINT / SIGHUP / SIGTERM: raise the agent's own ``SignalException``, so the
  agent forwards that signal to every worker and waits (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``,
  30 s by default) for them to stop at the step boundary and checkpoint
  ([Note: agreeing to stop] in fsdpkit.runtime.signals);
- a second one (an impatient Ctrl-C), or SIGQUIT: SIGKILL every worker's process
  group at once and raise ``ImmediateStop``: no save, and the launcher says so. A
  save cut short is an ignored ``.tmp`` directory; the newest complete checkpoint is
  untouched.

SIGHUP also points the launcher's stdout/stderr at /dev/null: the terminal is gone,
and printing to it would fail with EIO.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from types import FrameType
from typing import Any

from fsdpkit.runtime.signals import silence_terminal

GRACEFUL = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)
HANDLED = (*GRACEFUL, signal.SIGQUIT)


class ImmediateStop(Exception):
    """A second stop signal (or SIGQUIT): the workers were killed without a save."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped at once by {signal.Signals(signum).name}")
        self.signum = signum


def child_pids() -> list[int]:
    """This process's direct children (Linux /proc; every thread's)."""
    pids: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return pids


def kill_workers() -> None:
    """SIGKILL each child's process group (the agent starts each worker as a session
    leader, so its group is the worker and anything it started)."""
    for pid in child_pids():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


class LauncherSignals:
    """Installed around the elastic launch ([Note: stopping a spawned run])."""

    def __init__(self) -> None:
        self.first: int | None = None
        """The signal that asked the workers to stop and save."""
        self.settled = False
        """The workers are gone; later signals are ignored while the launcher reports."""
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if signum == signal.SIGHUP:
            silence_terminal()
        if self.settled:
            return
        if self.first is None and signum in GRACEFUL:
            self.first = signum
            raise SignalException(f"fsdpkit launcher got {signum}", signal.Signals(signum))
        kill_workers()
        raise ImmediateStop(signum)

    def __enter__(self) -> LauncherSignals:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
