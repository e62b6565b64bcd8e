"""Preemption: turn SIGTERM into a flag the training loop polls between steps.

A signal handler must not checkpoint by itself: it runs between two bytecodes of the
main thread, possibly inside a collective, and ranks receive the signal at different
moments. So the handler only sets a flag; the loop checks it once per step and all
ranks agree before acting.

[Note: agreeing to stop]
``stop = any_rank(flag(), device=...)`` (an all-reduce MAX over the training group) at
the same point of every step: if any rank was signalled, every rank saves the current
step with ``Checkpointer.save(step, state, blocking=True)``, calls ``wait()`` and exits
0. Without the all-reduce one rank would enter the save's collectives while the others
enter the next step's all-gathers, and the job hangs until the collective timeout.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist


def install_sigterm_flag(*, signals: tuple[int, ...] = (signal.SIGTERM,)) -> Callable[[], bool]:
    """Install a handler that records SIGTERM; returns ``flag()`` -> whether it arrived.

    Must be called from the main thread (Python delivers signals only there). A second
    SIGTERM while the flag is already set restores the previous handler and re-raises
    it, so an impatient scheduler can still kill the process."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_sigterm_flag must be called from the main thread")
    event = threading.Event()
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        if event.is_set():
            signal.signal(signum, previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        event.set()

    for sig in signals:
        previous[sig] = signal.getsignal(sig)
        signal.signal(sig, handler)
    return event.is_set


def any_rank(
    flag: bool, *, device: torch.device | str = "cpu", group: dist.ProcessGroup | None = None
) -> bool:
    """True on every rank if ``flag`` is true on any rank ([Note: agreeing to stop]).

    Collective over ``group`` (default: the training group); ``device`` must suit its
    backend (the local GPU for NCCL). Without a process group it returns ``flag``."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
