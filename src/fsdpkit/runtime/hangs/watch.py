"""The spawning launcher's side of hang triage: notice a hang, collect, report, stop.

[Note: hang triage, launcher side]
A thread of ``fsdpkit train``'s launcher reads its local ranks' progress records
([Note: progress record]) four times a second. It fires when

- a rank flags that a collective timed out (``parallel.timeout_s``): that rank waits
  for the report before it exits ([Note: hang triage, worker side]); or
- no rank has moved for ``parallel.hang_timeout_s`` (default 0.9 x ``timeout_s``, so
  before the collective timeout) once every rank has completed a step in this
  attempt. Start-up (loading, torch.compile, the first step) is left to the
  collective timeout: it is slow on every rank alike without being a hang.

Then it (1) bumps each record's ``request`` (the ranks' triage threads dump their
flight recorders) and sends every rank SIGUSR2 (faulthandler writes every thread's
stack, whatever the main thread is doing), (2) waits up to ``COLLECT_S`` for both,
(3) writes ``RUN_DIR/hang/report.txt`` and ``report.json`` ([Note: which rank is
behind]), (4) marks the records triaged and SIGKILLs the workers: a hung step cannot
checkpoint, and the newest complete checkpoint is untouched. The launcher then
prints the report's paragraph instead of the workers' deaths.

On several nodes each node's launcher sees only its own ranks; its report is
``report-nodeN.txt`` (N: the node's rank in the job, its first rank // nproc; host
names are not unique: two launchers may share a machine) and compares those, and
its paragraph names the node.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fsdpkit.runtime.hangs.behind import RankView, judge, paragraph, write_report
from fsdpkit.runtime.hangs.flight import (
    DUMP_PREFIX,
    FLIGHT_DIR,
    groups_of,
    load,
    read_summary,
    summarize,
)
from fsdpkit.runtime.hangs.probe import HANG_DIR, STACK_SIGNAL
from fsdpkit.runtime.hangs.record import Record, Snapshot, error_path, flight_path, stacks_path
from fsdpkit.runtime.interrupts import kill_workers

POLL_S = 0.25
COLLECT_S = 3.0
"""How long the launcher waits for stacks and flight-recorder dumps."""


@dataclass(frozen=True)
class HangReport:
    """What the launcher prints once the workers are gone."""

    path: Path
    message: str
    behind: list[int]


class HangWatch:
    """The launcher's watch thread (see the note)."""

    def __init__(
        self,
        *,
        control: Path,
        run_dir: Path,
        nproc: int,
        stall_s: float,
        timeout_s: float,
        several_nodes: bool = False,
    ) -> None:
        self.control = control
        self.hang_dir = run_dir / HANG_DIR
        self.nproc = nproc
        self.stall_s = stall_s
        self.timeout_s = timeout_s
        self.several_nodes = several_nodes
        self.report: HangReport | None = None
        self._records: dict[int, Record] = {}
        self._fired_pids: set[int] = set()
        self._started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fsdpkit-hang-watch", daemon=True)

    def __enter__(self) -> HangWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=COLLECT_S + 5)
        for record in self._records.values():
            with contextlib.suppress(BufferError, ValueError):
                record.close()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            snaps = self._snapshots()
            trigger = self._trigger(snaps)
            if trigger:
                self._fired_pids.update(s.pid for s in snaps)
                self._triage(snaps, trigger)

    def _snapshots(self) -> list[Snapshot]:
        """The live ranks' records, by global rank (re-mapped when a restarted worker
        renamed a new record into place)."""
        for path in self.control.glob("progress-rank-*"):
            rank = int(path.name.rsplit("-", 1)[1])
            old = self._records.get(rank)
            try:
                inode = path.stat().st_ino
            except OSError:
                continue
            if old is None or old.inode != inode:
                record = Record.open(path)
                if record is not None:
                    self._records[rank] = record
                    if old is not None:
                        old.close()
        snaps = [r.read() for _, r in sorted(self._records.items())]
        return [s for s in snaps if s.pid not in self._fired_pids and _alive(s.pid)]

    def _trigger(self, snaps: list[Snapshot]) -> str | None:
        timed_out = [s.rank for s in snaps if s.timed_out and not s.triaged]
        if timed_out:
            return (
                f"a collective of rank {timed_out[0]} timed out after {self.timeout_s:g} s "
                "(parallel.timeout_s)"
            )
        if self.stall_s <= 0 or len(snaps) < self.nproc:
            return None
        if not all(s.armed and s.phase not in ("setup", "finish") for s in snaps):
            return None
        idle = time.monotonic() - max(s.since for s in snaps)
        if idle <= self.stall_s:
            return None
        return (
            f"no rank made progress for {idle:.1f} s (parallel.hang_timeout_s = {self.stall_s:g})"
        )

    def _triage(self, snaps: list[Snapshot], trigger: str) -> None:
        for snap in snaps:
            record = self._records[snap.rank]
            flight_path(self.control, snap.rank).unlink(missing_ok=True)  # an older attempt's
            record.set_flag("request", snap.request + 1)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(snap.pid, STACK_SIGNAL)
        self._collect(snaps)
        now = time.monotonic()
        views = [self._view(s, now) for s in snaps]
        self.report = self._finish(views, trigger)
        for snap in snaps:
            self._records[snap.rank].set_flag("triaged", 1)

        kill_workers()

    def _finish(self, views: list[RankView], trigger: str) -> HangReport:
        """Judge, write the report, and say it."""
        verdict = judge(views)
        name = "report"
        if self.several_nodes and views:
            node = min(v.rank for v in views) // max(self.nproc, 1)
            name = f"report-node{node}"
            ranks = ", ".join(str(v.rank) for v in views)
            trigger = f"on node {node} (host {socket.gethostname()}, ranks {ranks}), {trigger}"
        path = self.hang_dir / f"{name}.txt"
        try:
            write_report(self.hang_dir, verdict, trigger=trigger, name=name)
        except OSError as exc:  # the paragraph still names the rank behind
            trigger += f" (the report could not be written to {path}: {exc.strerror or exc})"
        message = paragraph(verdict, trigger=trigger, report=path)
        return HangReport(path=path, message=message, behind=verdict.behind)

    def _collect(self, snaps: list[Snapshot]) -> None:
        deadline = time.monotonic() + COLLECT_S
        while time.monotonic() < deadline:
            pending = [
                s
                for s in snaps
                if _alive(s.pid)
                and (
                    not flight_path(self.control, s.rank).exists()
                    or not _settled(stacks_path(self.control, s.rank))
                )
            ]
            if not pending:
                return
            time.sleep(0.05)

    def post_mortem(self) -> HangReport | None:
        """After the workers died without a report: NCCL's watchdog, on a collective
        timeout, dumps each rank's flight recorder to ``RUN_DIR/hang/flight-recorder``
        (TORCH_NCCL_DUMP_ON_TIMEOUT) and aborts the process, too fast for Python
        stacks. From those dumps and the ranks' last records, the same report."""
        self._stop.set()
        self._thread.join(timeout=COLLECT_S + 5)
        self._snapshots()  # map records of ranks that died before the first poll
        current = [r.read() for r in self._records.values()]
        if self.report is not None and {s.pid for s in current} <= self._fired_pids:
            return self.report  # else a restarted attempt failed after the hang
        since = min((s.started for s in current), default=self._started)
        dumps = {}
        for path in (self.hang_dir / FLIGHT_DIR).glob(f"{DUMP_PREFIX}*"):
            with contextlib.suppress(OSError, ValueError):
                if path.stat().st_mtime >= since:
                    dumps[int(path.name[len(DUMP_PREFIX) :])] = path
        if not dumps:
            return None
        now = time.monotonic()
        views = []
        for rank, record in sorted(self._records.items()):
            snap = record.read()
            data = load(dumps[rank]) if rank in dumps else None
            views.append(
                RankView(
                    snapshot=snap,
                    idle_s=now - snap.since,
                    flight=summarize(data, groups=groups_of(data)) if data else None,
                    flight_note="" if data else "no dump from this rank",
                    error=_read(error_path(self.control, rank)),
                )
            )
        trigger = (
            f"NCCL's watchdog saw a collective time out (parallel.timeout_s = {self.timeout_s:g}) "
            f"and dumped the flight recorders of ranks {sorted(dumps)}"
        )
        return self._finish(views, trigger)

    def _view(self, snap: Snapshot, now: float) -> RankView:
        fresh = self._records[snap.rank].read()
        summary, note = read_summary(flight_path(self.control, snap.rank))
        if summary is not None and fresh.timed_out:
            summary = summary.timed_out()
        return RankView(
            snapshot=fresh,
            idle_s=now - fresh.since,
            stacks=_read(stacks_path(self.control, snap.rank)),
            flight=summary,
            flight_note=note,
            error=_read(error_path(self.control, snap.rank)),
        )


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _settled(path: Path) -> bool:
    """faulthandler wrote something and has not written for 0.2 s."""
    try:
        stat = path.stat()
    except OSError:
        return False
    return stat.st_size > 0 and time.time() - stat.st_mtime > 0.2


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return False


__all__ = ["HangReport", "HangWatch"]
