"""Workers never outlive their launcher, however it dies.

[Note: worker lifetime]
torch's elastic agent starts every worker in a session of its own
(``start_new_session=True``), so nothing the kernel or a terminal does to the
launcher's process group reaches the workers: ``kill -9 -- -PGID``, ``timeout -s
KILL``, a closed terminal or a container runtime killing the launcher used to leave
them training with parent pid 1, saving and deleting checkpoints under a rerun.

In our spawn path (and under torchrun) the agent runs inside the launcher process,
so a worker's parent IS the launcher. Two guards, set before the worker imports
torch:

1. ``PR_SET_PDEATHSIG`` (Linux ``prctl``): the kernel sends the worker SIGKILL the
   moment the thread that forked it exits (the agent's, which is the launcher's main
   thread: it lives as long as the launcher). SIGKILL, not SIGTERM: with the launcher
   gone nobody would report a save's outcome, and a save cut short is only an ignored
   ``.tmp`` directory (saves are atomic), so the newest complete checkpoint stays.
2. A watchdog thread that polls ``os.getppid()`` twice a second: once the launcher is
   gone the worker is re-parented (to 1 or a subreaper) and kills itself. It covers
   systems without ``prctl`` and the window before ``prctl`` ran (the launcher may
   die while the worker starts; ``bind_to_parent`` checks that first).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
POLL_S = 0.5
"""How often the watchdog checks the parent (the bound on how long an orphan lives
where ``prctl`` is unavailable)."""


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` when this process's parent thread exits
    (Linux only); whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int, interval: float) -> None:
    while True:
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(interval)


def bind_to_parent(parent: int, *, interval: float = POLL_S) -> None:
    """Die with ``parent`` ([Note: worker lifetime]); call first thing in a worker.

    ``parent`` is the pid the worker expects as its parent (the launcher). If it is
    already gone, the process kills itself at once."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    watchdog = threading.Thread(
        target=_watch, args=(parent, interval), name="fsdpkit-parent-watch", daemon=True
    )
    watchdog.start()
