"""The hang report: which rank is behind, and every rank's phase, collectives and stacks.

[Note: which rank is behind]
All ranks run the same program, so how far each got orders them: the last completed
step, then the phase within the step (data, then forward and backward per
micro-batch, then the optimizer: ``Snapshot.order``), then the number of collectives
it issued (the flight recorder's sequence numbers, summed over its groups). The
ranks with the smallest position are behind, unless every rank is at the same one:
then none is, and they all wait in a collective that completes nowhere (a network or
backend fault, or a rank of another node). A rank behind is usually computing,
sleeping or blocked outside a collective; its main thread's innermost Python frame
says where.

This module formats and never collects (the launcher's fsdpkit.runtime.hangs.watch and the
worker's fsdpkit.runtime.hangs.probe collect).
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpkit.runtime.hangs.flight import FlightSummary, human_bytes
from fsdpkit.runtime.hangs.record import Snapshot

STACKS_TITLE = "Python stacks (faulthandler, innermost frame first):"
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.MULTILINE)
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (\S+)', re.MULTILINE)


@dataclass(frozen=True)
class RankView:
    """What the launcher gathered about one rank."""

    snapshot: Snapshot
    idle_s: float
    """Seconds since the rank's last progress, at the report."""
    stacks: str = ""
    """faulthandler's dump of every thread (empty: none came)."""
    flight: FlightSummary | None = None
    flight_note: str = ""
    error: str = ""
    """The traceback of the rank's failed step (a collective timeout)."""

    @property
    def rank(self) -> int:
        return self.snapshot.rank

    @property
    def issued(self) -> int:
        return sum(self.flight.issued.values()) if self.flight else 0

    def main_stack(self) -> list[str]:
        """The main thread's frames, innermost first (``file:line in fn``)."""
        return main_thread_frames(self.stacks, self.snapshot.main_thread)


def main_thread_frames(stacks: str, ident: int) -> list[str]:
    """The frames of thread ``ident`` in a faulthandler dump, innermost first."""
    blocks = _THREAD.split(stacks)
    # split gives [before, kind, ident, body, kind, ident, body, ...]
    for i in range(1, len(blocks) - 2, 3):
        if int(blocks[i + 1], 16) == ident:
            return [f"{f}:{n} in {fn}" for f, n, fn in _FRAME.findall(blocks[i + 2])]
    return []


@dataclass(frozen=True)
class Verdict:
    behind: list[int]
    """The ranks that lag (empty: all at the same point)."""
    views: list[RankView] = field(default_factory=list)


def judge(views: list[RankView]) -> Verdict:
    """[Note: which rank is behind]"""
    if not views:
        return Verdict(behind=[], views=views)
    counted = all(v.flight is not None for v in views)

    def position(v: RankView) -> tuple[Any, ...]:
        return (v.snapshot.order, v.issued if counted else 0)

    lowest = min(position(v) for v in views)
    behind = [v.rank for v in views if position(v) == lowest]
    return Verdict(behind=[] if len(behind) == len(views) else behind, views=views)


def _where(view: RankView) -> str:
    frames = view.main_stack()
    place = f", at {_short(frames[0])}" if frames else ""
    return f"{view.snapshot.where()} for {view.idle_s:.1f} s{place}"


def _short(frame: str) -> str:
    """``tests/e2e/factories.py:95 in forward`` from an absolute path: the last
    three path parts are enough to find it."""
    path, _, rest = frame.partition(":")
    return "/".join(Path(path).parts[-3:]) + ":" + rest


def _waiting(view: RankView, behind: list[RankView]) -> str:
    last = view.flight.last if view.flight else None
    if last is None:
        return f"rank {view.rank} is in {view.snapshot.where()}"
    text = (
        f"rank {view.rank} waits in collective #{last.seq} {last.op} "
        f"({_size(last.bytes)}, group {last.group} {last.group_desc}, {last.state})"
    )
    missing = [
        f"rank {b.rank} (its last there is #{b.flight.issued.get(last.group, 0)})"
        for b in behind
        if b.flight is not None and b.flight.issued.get(last.group, 0) < last.seq
    ]
    return text + (f", which {' and '.join(missing)} has not issued" if missing else "")


def _size(n: int) -> str:

    return human_bytes(n)


def paragraph(verdict: Verdict, *, trigger: str, report: Path) -> str:
    """The one paragraph the launcher prints."""
    views = {v.rank: v for v in verdict.views}
    if verdict.behind:
        names = ", ".join(str(r) for r in verdict.behind)
        lag = " ".join(
            f"Rank {r} is behind: it is in {_where(views[r])}{_issued_note(views[r])}."
            for r in verdict.behind
        )
        lagging = [views[r] for r in verdict.behind]
        others = "; ".join(
            _waiting(v, lagging) for r, v in sorted(views.items()) if r not in verdict.behind
        )
        body = f"{lag} The others wait for rank{'s' if len(verdict.behind) > 1 else ''} {names}"
        body += f": {others}." if others else "."
    elif views:
        first = next(iter(views.values()))
        body = (
            f"No rank is behind: every rank is in {first.snapshot.where()} with the same "
            f"collectives issued, so a collective completes on none of them: "
            f"{_waiting(first, [])}. That points at the network or the backend (or a rank on "
            "another node)."
        )
    else:
        body = "No rank's progress record was found."
    return f"the run hung: {trigger}. {body} Every rank's phase, last collectives and " + (
        f"Python stacks: {report}."
    )


def _issued_note(view: RankView) -> str:
    return f", {view.issued} collectives issued" if view.flight is not None else ""


def render_rank(view: RankView, *, stacks: bool = True) -> str:
    """One rank's section of the report (``stacks``: with its faulthandler dump)."""
    snap = view.snapshot
    lines = [
        f"== rank {snap.rank} (pid {snap.pid}) ==",
        f"where: {snap.where()}, {view.idle_s:.1f} s without progress"
        + (" (its collective timed out)" if snap.timed_out else ""),
    ]
    if view.flight is not None:
        groups = ", ".join(
            f"group {g} (ranks {view.flight.groups.get(g, '?')}): {n}"
            for g, n in sorted(view.flight.issued.items())
        )
        lines.append(f"collectives issued: {groups}")
        lines.append("last collectives (flight recorder, newest first):")
        for i, c in enumerate(view.flight.recent):
            lines.append(f"  {c.describe()}")
            if i == 0 and c.frames:
                lines += [f"      issued from {f}" for f in c.frames[:6]]
    else:
        lines.append(f"flight recorder: {view.flight_note or 'no answer'}")
    if view.error:
        lines += ["error of its failed step:", *("  " + x for x in view.error.splitlines())]
    lines.append(STACKS_TITLE)
    if stacks:
        body = (
            view.stacks.strip()
            or "(none: the process did not answer SIGUSR2 in time, or was already gone)"
        )
        lines += ["  " + _label_main(x, snap.main_thread) for x in body.splitlines()]
    return "\n".join(lines)


def _label_main(line: str, ident: int) -> str:
    """faulthandler's header of the main thread, marked as such."""
    if line.endswith("(most recent call first):") and f"0x{ident:016x}" in line:
        return line[: -len(":")] + " [main thread]:"
    return line


def _header(trigger: str) -> list[str]:
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return [f"fsdpkit hang report, {now}, host {socket.gethostname()}", f"trigger: {trigger}"]


def write_report(hang_dir: Path, verdict: Verdict, *, trigger: str, name: str = "report") -> Path:
    """``hang_dir/NAME.txt`` (paragraph, table, every rank) and ``NAME.json``."""
    hang_dir.mkdir(parents=True, exist_ok=True)
    path = hang_dir / f"{name}.txt"
    table = [f"{'rank':>4}  {'pid':>7}  {'step':>6}  {'idle s':>6}  where / last collective"]
    for v in verdict.views:
        last = v.flight.last.describe() if v.flight and v.flight.last else v.flight_note
        table.append(
            f"{v.rank:>4}  {v.snapshot.pid:>7}  {v.snapshot.step:>6}  {v.idle_s:>6.1f}  "
            f"{v.snapshot.where()} / {last}"
        )
    text = [
        *_header(trigger),
        "",
        paragraph(verdict, trigger=trigger, report=path),
        "",
        *table,
        "",
        *(render_rank(v) + "\n" for v in verdict.views),
    ]
    path.write_text("\n".join(text))
    (hang_dir / f"{name}.json").write_text(json.dumps(_as_json(verdict, trigger), indent=1))
    return path


def _as_json(verdict: Verdict, trigger: str) -> dict[str, Any]:
    ranks = []
    for v in verdict.views:
        snap = v.snapshot
        ranks.append(
            {
                "rank": snap.rank,
                "pid": snap.pid,
                "step": snap.step,
                "phase": snap.phase,
                "micro_batch": snap.micro,
                "idle_s": round(v.idle_s, 3),
                "timed_out": snap.timed_out,
                "collectives_issued": v.flight.issued if v.flight else None,
                "last_collectives": v.flight.to_json()["recent"] if v.flight else None,
                "flight_note": v.flight_note,
                "main_thread": v.main_stack(),
                "stacks": v.stacks,
                "error": v.error,
            }
        )
    return {"trigger": trigger, "behind": verdict.behind, "ranks": ranks}


def write_rank_report(
    hang_dir: Path,
    *,
    snapshot: Snapshot,
    summary: FlightSummary | None,
    note: str,
    why: str,
) -> Path:
    """A rank's own report when no launcher collects (torchrun, SLURM): its record,
    its recorder and every thread's stack (faulthandler, from this thread)."""
    import time

    hang_dir.mkdir(parents=True, exist_ok=True)
    path = hang_dir / f"rank-{snapshot.rank}.txt"
    view = RankView(
        snapshot=snapshot,
        idle_s=time.monotonic() - snapshot.since,
        flight=summary,
        flight_note=note,
    )
    with path.open("w") as f:
        f.write("\n".join([*_header(why), "", render_rank(view, stacks=False), ""]))
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    return path
