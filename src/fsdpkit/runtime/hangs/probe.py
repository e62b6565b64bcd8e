"""The worker's side of hang triage: phase marks, stacks on request, a triage thread.

[Note: hang triage, worker side]
``HangProbe.start(cfg, env)`` runs in every rank before the process group exists:

1. a progress record ([Note: progress record]) that the training loop moves at each
   phase boundary (``phase``, ``marker`` for ``train_step``'s ``mark`` hook,
   ``step_done``);
2. under the spawning launcher, ``faulthandler`` registered on SIGUSR2: the launcher's
   signal makes the C-level handler write every thread's Python stack to
   ``stacks-rank-R.txt`` in the control directory, even while the main thread sits
   in a collective or in C code holding the GIL;
3. a daemon thread that wakes every 0.2 s: when the launcher bumps ``request`` it
   dumps the flight recorder ([Note: flight recorder]) and answers; without a
   launcher (torchrun, SLURM) it watches this rank's own record and, after
   ``parallel.hang_timeout_s`` without progress, writes ``RUN_DIR/hang/rank-R.txt``
   itself (its stacks, its record, its recorder).

A step that fails with a collective timeout (``failed``) flags the record and, under
the launcher, waits up to ``ACK_S`` for the launcher's report before the exception
goes on: the launcher collects the stacks of the ranks that are still alive, and the
elastic agent would stop them the moment this rank exits.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO

from fsdpkit.runtime.hangs import flight
from fsdpkit.runtime.hangs.behind import write_rank_report
from fsdpkit.runtime.hangs.record import (
    Record,
    Snapshot,
    error_path,
    flight_path,
    record_path,
    stacks_path,
)

STACK_SIGNAL = signal.SIGUSR2
"""The signal the launcher sends for stacks (nothing in torch or fsdpkit uses it)."""
POLL_S = 0.2
ACK_S = 15.0
"""How long a rank whose collective timed out waits for the launcher's report."""
HANG_DIR = "hang"


def hang_timeout(timeout_s: float, hang_timeout_s: float | None) -> float:
    """``parallel.hang_timeout_s``, its default resolved: 0.9 x ``parallel.timeout_s``,
    so the report comes before the collective timeout (on NCCL the watchdog then
    aborts the process, leaving no Python stacks). 0: no stall watch."""
    return 0.9 * timeout_s if hang_timeout_s is None else hang_timeout_s


def is_timeout(exc: BaseException) -> bool:
    """Whether a failed step is a collective timeout (gloo: "Timed out waiting
    ...ms for recv operation"; NCCL: "Watchdog caught collective operation timeout")."""
    seen: BaseException | None = exc
    while seen is not None:
        if "timed out" in str(seen).lower() or "timeout" in type(seen).__name__.lower():
            return True
        seen = seen.__cause__
    return False


class HangProbe:
    """A rank's progress, stacks and flight recorder for hang triage (see the note)."""

    def __init__(
        self,
        record: Record,
        *,
        rank: int,
        run_dir: Path | None,
        control: Path | None,
        stall_s: float,
    ) -> None:
        self.record = record
        self.rank = rank
        self.run_dir = run_dir
        self.control = control
        self.stall_s = stall_s
        self._step = 0
        self._micro_batches = 1
        self._armed = False
        self._stacks: IO[str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported = False

    @classmethod
    def start(
        cls,
        *,
        rank: int,
        run_dir: Path,
        control: Path | None,
        timeout_s: float,
        hang_timeout_s: float | None,
    ) -> HangProbe:
        """Install the probe in this worker (main thread, before the process group)."""
        probe = cls(
            Record.create(record_path(control, rank) if control else None, rank=rank),
            rank=rank,
            run_dir=run_dir,
            control=control,
            stall_s=hang_timeout(timeout_s, hang_timeout_s),
        )
        if control is not None:  # stacks on the launcher's signal, before it can send one
            probe._stacks = stacks_path(control, rank).open("w")
            faulthandler.register(STACK_SIGNAL, file=probe._stacks, all_threads=True, chain=False)
        probe._thread = threading.Thread(target=probe._serve, name="fsdpkit-hang", daemon=True)
        probe._thread.start()
        return probe

    @classmethod
    def off(cls) -> HangProbe:
        """A probe that records into anonymous memory and watches nothing (library
        callers and tests that do not want triage)."""
        return cls(Record.create(None, rank=0), rank=0, run_dir=None, control=None, stall_s=0)

    # -- the training loop's marks ------------------------------------------------
    def phase(self, name: str, *, micro: int = 0) -> None:
        self.record.write(step=self._step, phase=name, micro=micro, armed=self._armed)

    def marker(self, micro_batches: int) -> Callable[[str], None]:
        """``train_step``'s ``mark`` hook: it names the phase that just ended."""
        self._micro_batches = micro_batches
        self.phase("forward", micro=0)
        state = {"micro": 0}

        def mark(ended: str) -> None:
            if ended == "forward":
                self.phase("backward", micro=state["micro"])
            elif ended == "backward":
                state["micro"] += 1
                last = state["micro"] >= self._micro_batches
                self.phase("optimizer" if last else "forward", micro=0 if last else state["micro"])

        return mark

    def step_done(self, step: int) -> None:
        """The optimizer step of ``step`` ended: the loss all-reduce and logging follow."""
        self._step, self._armed = step, True
        self.phase("metrics")

    def resumed(self, step: int) -> None:
        self._step = step
        self.phase("setup")

    def failed(self, exc: BaseException) -> None:
        """A step raised: on a collective timeout, flag it and let the launcher (if
        any) report before this rank exits; without one, report this rank."""
        if not is_timeout(exc) or self._reported:
            return
        snap = self.record.read()
        text = "".join(traceback.format_exception(exc))
        if self.control is not None:
            error_path(self.control, self.rank).write_text(text)
            self.record.write(
                step=snap.step,
                phase=snap.phase,
                micro=snap.micro,
                armed=snap.armed,
                timed_out=True,
                since=snap.since,  # a timeout is no progress
            )
            deadline = time.monotonic() + ACK_S
            while not self.record.read().triaged and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            self._self_report(why=f"a collective timed out:\n{text}")

    def close(self) -> None:
        self._stop.set()
        if self._stacks is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                faulthandler.unregister(STACK_SIGNAL)

    # -- the triage thread --------------------------------------------------------
    def _serve(self) -> None:
        answered = 0
        while not self._stop.wait(POLL_S):
            snap = self.record.read()
            if self.control is not None and snap.request > answered:
                answered = snap.request
                self._answer()
                self.record.set_flag("answered", answered)
            elif self.control is None and self._stalled(snap):
                self._self_report(why=f"no progress for {self.stall_s:.0f} s")

    def _stalled(self, snap: Snapshot) -> bool:
        idle = time.monotonic() - snap.since
        watched = snap.armed and snap.phase not in ("setup", "finish")
        return not self._reported and self.stall_s > 0 and watched and idle > self.stall_s

    def _answer(self) -> None:
        assert self.control is not None
        summary, note = self._flight()
        flight.write_summary(summary, flight_path(self.control, self.rank), note=note)

    def _flight(self) -> tuple[flight.FlightSummary | None, str]:
        hang_dir = self.run_dir / HANG_DIR if self.run_dir else None
        groups = flight.group_ranks()
        try:
            data = flight.dump(rank=self.rank, hang_dir=hang_dir, groups=groups)
        except Exception as exc:  # a report without the recorder is still a report
            return None, f"flight recorder dump failed: {type(exc).__name__}: {exc}"
        if data is None:
            return None, "flight recorder off (TORCH_FR_BUFFER_SIZE=0) or empty"
        return flight.summarize(data, groups=groups), ""

    def _self_report(self, *, why: str) -> None:
        """Without a launcher: this rank's own report (joined runs)."""

        if self.run_dir is None:
            return
        self._reported = True
        summary, note = self._flight()
        write_rank_report(
            self.run_dir / HANG_DIR,
            snapshot=self.record.read(),
            summary=summary,
            note=note,
            why=why,
        )


__all__ = ["HangProbe", "hang_timeout", "is_timeout"]
