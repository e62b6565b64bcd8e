"""Where a rank is: a few bytes in shared memory, rewritten at every phase boundary.

[Note: progress record]
Each rank owns one fixed-size record: the last completed step, the phase it is in
(with the micro-batch), when that phase began (``time.monotonic()``, which is one
clock for every process of a machine), and whether its last step failed on a
collective timeout. The worker's main thread rewrites it with one ``pack_into`` per
phase boundary (about 1 us; a step has 2 + 2 x micro-batches of them). Under the
spawning launcher the record is a 128-byte file in the launcher's control directory,
mapped by both; the launcher reads it without any call into the worker, even one
whose Python threads are all blocked. Without a launcher (torchrun, SLURM) it is
anonymous memory the worker's own triage thread reads.

Torn reads: the writer sets ``seq`` odd, writes, then sets it even (a seqlock); a
reader retries until it reads the same even ``seq`` before and after the fields. The launcher and
the worker also exchange three counters in fields only one side writes: ``request``
(launcher: "dump your flight recorder"), ``answered`` (worker: done) and ``triaged``
(launcher: the report is written; a rank that timed out may exit).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x484B5346  # "FSKH"
PHASES = (
    "setup",
    "metrics",
    "eval",
    "checkpoint",
    "data",
    "forward",
    "backward",
    "optimizer",
    "finish",
)
"""In the order one step goes through them after the step counter last moved: the
loss all-reduce and logging of step N (``metrics``), its evaluation and checkpoint,
then step N + 1's stop agreement and batches (``data``), its micro-batches and its
optimizer step; ``step`` becomes N + 1 when that ends. ``setup`` is everything before
the first step, ``finish`` everything after the last."""
PHASE_CODE = {name: i for i, name in enumerate(PHASES)}

_HEAD = struct.Struct("<IIqQd")  # magic, rank, pid, main thread ident, started (wall clock)
_BODY = struct.Struct("<IqHHBBxxd")  # seq, step, phase, micro, armed, timed_out, since
_SEQ = struct.Struct("<I")
_FLAGS = struct.Struct("<III")  # request (launcher), answered (worker), triaged (launcher)
_BODY_AT = _HEAD.size
_FLAGS_AT = 64
SIZE = 128


@dataclass(frozen=True)
class Snapshot:
    """One consistent read of a record."""

    rank: int
    pid: int
    main_thread: int
    """``threading.main_thread().ident``: faulthandler prints it as ``Thread 0x...``."""
    started: float
    """``time.time()`` when the worker created the record (its attempt's start)."""
    step: int
    """The last completed step."""
    phase: str
    micro: int
    armed: bool
    """The rank completed a step since it started: from then on a stall is a hang
    (before, long start-ups such as torch.compile or loading weights are normal)."""
    timed_out: bool
    since: float
    """``time.monotonic()`` when the phase began (the rank's last progress)."""
    request: int
    answered: int
    triaged: int

    @property
    def order(self) -> tuple[int, int, int]:
        """How far the rank got: compares ranks that run the same program."""
        if self.phase in ("forward", "backward"):  # micro-batches alternate the two
            sub = 2 * self.micro + (self.phase == "backward")
            return (self.step, PHASE_CODE["forward"], sub)
        return (self.step, PHASE_CODE.get(self.phase, 0), 0)

    def where(self) -> str:
        """``forward (micro-batch 1) of step 3`` and the like."""
        if self.phase in ("forward", "backward"):
            return f"{self.phase} (micro-batch {self.micro}) of step {self.step + 1}"
        if self.phase in ("data", "optimizer"):
            return f"{self.phase} of step {self.step + 1}"
        if self.phase in ("metrics", "eval", "checkpoint"):
            return f"{self.phase} after step {self.step}"
        return f"{self.phase} (last step {self.step})"


class Record:
    """A progress record over a writable buffer (a mapped file or anonymous memory)."""

    def __init__(self, buffer: mmap.mmap, path: Path | None = None, inode: int = 0) -> None:
        self.buffer = buffer
        self.path = path
        self.inode = inode
        """The mapped file's inode: a restarted worker's record is a new file."""
        self._seq = 0
        self._lock = threading.Lock()  # the triage thread writes too (timed_out, answered)

    @classmethod
    def create(cls, path: Path | None, *, rank: int) -> Record:
        """The worker's record (``path`` None: anonymous memory), written as ``setup``."""
        if path is None:
            buffer = mmap.mmap(-1, SIZE)
        else:  # a new file renamed into place: a reader's old mapping stays valid
            tmp = path.with_name(f".{path.name}.tmp")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, SIZE)
                buffer = mmap.mmap(fd, SIZE)
            finally:
                os.close(fd)
        record = cls(buffer, path)
        ident = threading.main_thread().ident or 0
        _HEAD.pack_into(buffer, 0, MAGIC, rank, os.getpid(), ident, time.time())
        record.write(step=0, phase="setup", micro=0, armed=False, timed_out=False)
        if path is not None:
            os.replace(tmp, path)
        return record

    @classmethod
    def open(cls, path: Path) -> Record | None:
        """Map an existing record (the launcher's side); None if not (yet) one."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            stat = os.fstat(fd)
            if stat.st_size < SIZE:
                return None
            buffer = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        if _HEAD.unpack_from(buffer, 0)[0] != MAGIC:
            buffer.close()
            return None
        return cls(buffer, path, inode=stat.st_ino)

    def write(
        self,
        *,
        step: int,
        phase: str,
        micro: int,
        armed: bool,
        timed_out: bool = False,
        since: float | None = None,
    ) -> None:
        """The worker's update ([Note: progress record]: seqlock, one writer); ``since``
        defaults to now (progress)."""
        with self._lock:
            self._seq += 1  # odd while writing
            _SEQ.pack_into(self.buffer, _BODY_AT, self._seq)
            _BODY.pack_into(
                self.buffer,
                _BODY_AT,
                self._seq,
                step,
                PHASE_CODE[phase],
                micro,
                armed,
                timed_out,
                time.monotonic() if since is None else since,
            )
            self._seq += 1
            _SEQ.pack_into(self.buffer, _BODY_AT, self._seq)

    def read(self) -> Snapshot:
        """A consistent snapshot (retries while the writer is mid-update)."""
        _, rank, pid, ident, started = _HEAD.unpack_from(self.buffer, 0)
        for _ in range(1000):
            before = _SEQ.unpack_from(self.buffer, _BODY_AT)[0]
            body = _BODY.unpack_from(self.buffer, _BODY_AT)
            if before % 2 == 0 and _SEQ.unpack_from(self.buffer, _BODY_AT)[0] == before:
                break
        _, step, phase, micro, armed, timed_out, since = body
        request, answered, triaged = _FLAGS.unpack_from(self.buffer, _FLAGS_AT)
        return Snapshot(
            rank=rank,
            pid=pid,
            main_thread=ident,
            started=started,
            step=step,
            phase=PHASES[phase] if phase < len(PHASES) else "setup",
            micro=micro,
            armed=bool(armed),
            timed_out=bool(timed_out),
            since=since,
            request=request,
            answered=answered,
            triaged=triaged,
        )

    def set_flag(self, name: str, value: int) -> None:
        """Write one of ``request`` / ``answered`` / ``triaged``."""
        index = ("request", "answered", "triaged").index(name)
        _SEQ.pack_into(self.buffer, _FLAGS_AT + 4 * index, value)

    def close(self) -> None:
        self.buffer.close()


def record_path(control: Path, rank: int) -> Path:
    return control / f"progress-rank-{rank}"


def stacks_path(control: Path, rank: int) -> Path:
    """Where the rank's faulthandler writes every thread's stack on SIGUSR2."""
    return control / f"stacks-rank-{rank}.txt"


def flight_path(control: Path, rank: int) -> Path:
    """Where the rank's triage thread writes its flight-recorder entries (JSON)."""
    return control / f"flight-rank-{rank}.json"


def error_path(control: Path, rank: int) -> Path:
    """The traceback of a rank's failed step (a collective timeout), for the report."""
    return control / f"step-error-rank-{rank}.txt"
