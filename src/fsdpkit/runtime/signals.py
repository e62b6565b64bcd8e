"""Stop requests: SIGTERM, SIGINT (Ctrl-C) and SIGHUP become a flag the training loop
polls between steps.

A signal handler must not checkpoint by itself: it runs between two bytecodes of the
main thread, possibly inside a collective, and ranks receive the signal at different
moments. So the handler only records which signal arrived; the loop checks it once
per step and all ranks agree before acting.

[Note: agreeing to stop]
``signum = agreed_signal(flag.signum, device=...)`` (an all-reduce MAX over the
training group) at the same point of every step: if any rank was signalled, every
rank learns the same signal number, saves the current step with
``Checkpointer.save(step, state, blocking=True)``, calls ``wait()`` and exits with
``128 + signum`` (143 SIGTERM, 130 SIGINT, 129 SIGHUP, 138 SIGUSR1), as a process ended by that
signal would. Without the all-reduce one rank would enter the save's collectives
while the others enter the next step's all-gathers, and the job hangs until the
collective timeout.

[Note: second signal]
A second signal while a stop is pending means "now": the process exits at once with
``128 + signum`` without saving (the newest complete checkpoint on disk is untouched:
saves are atomic). SIGHUP also points a terminal stdout/stderr at /dev/null first: it
means the terminal is gone, and a print to a hung-up terminal fails with EIO, which
would crash the save the stop is waiting for.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed as dist

from fsdpkit.runtime import slurm

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
"""Signals that stop a run at the next step boundary with a checkpoint (SIGUSR1: a
scheduler's warning before the time limit, ``sbatch --signal=USR1@GRACE``; exit 138)."""


class StopFlag:
    """Which stop signal arrived first (``signum``; None: none yet). Calling it returns
    whether one arrived, so it also serves where a ``flag()`` callable is expected."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.on_second: Callable[[int], None] | None = None
        """Called (in the handler) before a second signal ends the process; e.g. to say
        what happened."""
        self.repeat_is_second = True
        """Whether the first signal arriving again counts as a second one; not in a SLURM
        task ([Note: repeated SLURM signals] in fsdpkit.runtime.slurm)."""

    def __call__(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            silence_terminal()
        if self.signum is None:
            self.signum = signum
            return
        if signum == self.signum and not self.repeat_is_second:
            return
        if self.on_second is not None:
            self.on_second(signum)
        sys.stdout.flush()
        os._exit(128 + signum)


def silence_terminal() -> None:
    """Point stdout / stderr at /dev/null where they are a terminal (it hung up);
    redirected output (files, pipes) keeps flowing."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    for fd in (1, 2):
        try:  # a hung-up terminal fails isatty(); a character device is what matters
            mode, device = os.fstat(fd).st_mode, os.fstat(fd).st_rdev
            if stat.S_ISCHR(mode) and device != os.fstat(null).st_rdev:
                os.dup2(null, fd)
        except OSError:
            continue
    os.close(null)


def install_stop_flag(*, signals: tuple[int, ...] = STOP_SIGNALS) -> StopFlag:
    """Install handlers that record the first of ``signals``; returns the flag.

    Must be called from the main thread (Python delivers signals only there). A second
    signal ends the process at once ([Note: second signal])."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_stop_flag must be called from the main thread")
    flag = StopFlag()
    flag.repeat_is_second = not slurm.in_task(os.environ)
    for sig in signals:
        signal.signal(sig, flag._handle)
    return flag


def install_sigterm_flag(*, signals: tuple[int, ...] = (signal.SIGTERM,)) -> StopFlag:
    """``install_stop_flag`` for SIGTERM only (kept for existing callers)."""
    return install_stop_flag(signals=signals)


def agreed_signal(
    signum: int | None,
    *,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
) -> int:
    """The largest signal number any rank received (0: none); the same on every rank
    ([Note: agreeing to stop]). Collective over ``group``; without a process group it
    returns this rank's own."""
    if not (dist.is_available() and dist.is_initialized()):
        return signum or 0
    t = torch.tensor([signum or 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def any_rank(
    flag: bool, *, device: torch.device | str = "cpu", group: dist.ProcessGroup | None = None
) -> bool:
    """True on every rank if ``flag`` is true on any rank ([Note: agreeing to stop]).

    Collective over ``group`` (default: the training group); ``device`` must suit its
    backend (the local GPU for NCCL). Without a process group it returns ``flag``."""
    return agreed_signal(1 if flag else None, device=device, group=group) > 0


def describe_stop(signum: int) -> str:
    """``SIGINT (Ctrl-C)`` and friends, for messages."""
    extra = {
        int(signal.SIGINT): " (Ctrl-C)",
        int(signal.SIGHUP): " (terminal closed)",
        int(signal.SIGUSR1): " (the time limit is near)",
    }
    return signal.Signals(signum).name + extra.get(int(signum), "")
