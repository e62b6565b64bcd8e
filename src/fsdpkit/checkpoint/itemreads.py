"""How the verified load reads one checkpoint file: its items' bytes, in file order.

[Note: reading an owned file]
The rank that owns a file crc32s every byte of it in order ([Note: verified
single-pass load]); at the saving world size it also loads nearly all of them. Per item
a load needs the item's head (``records.HEAD`` bytes, which locate the tensor), then
its payload, read straight into the target. It used to prefetch every item's head with
``posix_fadvise`` (a small random read per item, all queued ahead of the stream) and
read each head, payload and gap separately, and ran at 0.55-0.63x the raw sequential
read of the same bytes. Now:

- ``read_ahead``: before DCP plans the load, the kernel is asked to read the first
  ``WINDOW`` bytes of the owned files, so the disk streams while the plan is made;
  ``ItemFile`` then keeps it reading ``WINDOW`` ahead of the payloads, a quarter
  window per request.
- an owner's payload read also reads the ``TAIL`` bytes after it (the item's zip
  trailer and the next item's head) in the same ``preadv``, so the next head and the
  bytes hashed between payloads come from memory: one read per item instead of three.

bench/checkpoint_io.py's model, 2 ranks, the old and new reader alternated in one run
(21 repetitions on a loaded machine): 0.55x -> 0.65x of the raw read with a 128 MiB
window; a 32 MiB window gained nothing (0.58x), and reading the whole file ahead made
some loads twice as slow (both ranks' whole files queued at once).

Files this rank does not own are read slice by slice (after a reshard, the parts of
other ranks' files it loads): each item's head is prefetched, nothing more is read.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fsdpkit.checkpoint.checksum import crc32
from fsdpkit.checkpoint.records import HEAD

WINDOW = 128 << 20
"""How far ahead of an owner's reads the kernel is kept reading (``read_ahead`` at the
start, then ``ItemFile`` as it goes). Measured against 32 MiB and the whole file
([Note: reading an owned file])."""
TAIL = 8 << 10
"""Bytes read after each payload of an owned file: its trailer (~0.9 KiB) and the
``HEAD`` that ``records.tensor_record`` reads from the next item's start. What of it
runs into the next payload (~6.5 KiB per item) is read again, from the page cache."""
_GAP = 8 << 20


@dataclass
class LoadStats:
    """What one load read and where its time went (this rank)."""

    bytes: int = 0
    read_s: float = 0.0
    checksum_s: float = 0.0
    direct_bytes: int = 0
    """Bytes read straight into their target tensors (no copy)."""
    load_s: float = 0.0
    """Wall time of the whole ``dcp.load`` (planning, reads, ``load_state_dict``)."""


def read_ahead(paths: Iterable[Path], *, budget: int | None = None) -> None:
    """Ask the kernel to start reading ``paths`` front to back into the page cache, up
    to ``budget`` bytes in all (``WINDOW``), without waiting ([Note: reading an owned
    file])."""
    budget = WINDOW if budget is None else budget
    for path in paths:
        if budget <= 0:
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # the load names the file that cannot be read
        try:
            n = min(os.fstat(fd).st_size, budget)
            _advise(fd, 0, n)
            budget -= n
        finally:
            os.close(fd)


def _advise(fd: int, offset: int, n: int) -> None:
    """``POSIX_FADV_WILLNEED`` for ``n`` bytes at ``offset``: advice only, so a file
    system or platform that refuses it changes nothing."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)


class ItemFile:
    """One open checkpoint file, read item by item; ``owned``: crc32 every byte front
    to back, reading each payload together with the bytes after it."""

    def __init__(self, path: Path, *, owned: bool, stats: LoadStats) -> None:
        self.name = path.name
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.owned, self.stats = owned, stats
        self.pos, self.crc = 0, 0
        self._gap: bytearray | None = None
        self._held = bytearray(TAIL if owned else 0)
        self._held_at, self._held_n = 0, 0
        """``_held[:_held_n]`` are the file's bytes at ``_held_at``."""
        self._advised = 0
        """The kernel was asked to read the file up to here."""

    def close(self) -> None:
        os.close(self.fd)

    def prefetch(self, offset: int, length: int) -> None:
        """Start reading an item's head into the page cache without waiting, so the
        small read that locates its tensor does not cost a disk round trip. An owned
        file needs none: ``read_ahead`` streams it, and each head arrives in the read
        before it."""
        if not self.owned:
            _advise(self.fd, offset, min(length, HEAD))

    def pread(self, offset: int, n: int) -> bytes:
        held = self._in_memory(offset, n)
        if held is not None:
            return bytes(held)
        if not self.owned:
            out = bytearray(n)
            if self.pread_into([memoryview(out)], offset) < n:
                raise EOFError(f"{self.name} ends before byte {offset + n}")
            return bytes(out)
        if n > len(self._held):
            self._held = bytearray(n)
        want = memoryview(self._held)[: max(n, min(len(self._held), self.size - offset))]
        self._held_at, self._held_n = offset, self.pread_into([want], offset)
        held = self._in_memory(offset, n)
        if held is None:
            raise EOFError(f"{self.name} ends at byte {offset + self._held_n}")
        return bytes(held)

    def take(self, view: memoryview, offset: int) -> None:
        """Read ``view.nbytes`` bytes at ``offset`` into ``view``; an owner first hashes
        the bytes up to ``offset`` so its crc32 stays in file order, and keeps the
        ``TAIL`` bytes after ``view`` in memory."""
        if not self.owned:
            if self.pread_into([view], offset) < view.nbytes:
                raise EOFError(f"{self.name} ends before byte {offset + view.nbytes}")
            return
        self.skip_to(offset)
        self._keep_ahead(offset + view.nbytes + WINDOW)
        tail = max(0, min(TAIL, self.size - offset - view.nbytes))  # no read past the end
        got = self.pread_into([view, memoryview(self._held)[:tail]], offset)
        if got < view.nbytes:
            raise EOFError(f"{self.name} ends at byte {offset + got}")
        self._held_at, self._held_n = offset + view.nbytes, got - view.nbytes
        self._hash(view)
        self.pos = offset + view.nbytes

    def skip_to(self, end: int) -> None:
        """Owner: hash [pos, end) without keeping it, from memory where it is held."""
        held = self._in_memory(self.pos, max(0, min(end, self._held_at + self._held_n) - self.pos))
        if held is not None and held.nbytes:
            self._hash(held)
            self.pos += held.nbytes
        want = min(_GAP, end - self.pos)
        if want > 0 and (self._gap is None or len(self._gap) < want):
            self._gap = bytearray(max(want, 64 << 10))
        while self.pos < end:
            assert self._gap is not None
            chunk = memoryview(self._gap)[: min(len(self._gap), end - self.pos)]
            if self.pread_into([chunk], self.pos) < chunk.nbytes:
                raise EOFError(f"{self.name} ends before byte {end}")
            self._hash(chunk)
            self.pos += chunk.nbytes

    def pread_into(self, views: list[memoryview], offset: int) -> int:
        """Fill ``views`` front to back from ``offset`` until they are full or the file
        ends; the bytes read."""
        t0 = time.perf_counter()
        total, done = sum(v.nbytes for v in views), 0
        while done < total:
            n = os.preadv(self.fd, _after(views, done), offset + done)
            if n == 0:
                break
            done += n
        self.stats.read_s += time.perf_counter() - t0
        self.stats.bytes += done
        return done

    def _keep_ahead(self, end: int) -> None:
        """Keep the kernel reading up to ``end``, in steps of at least a quarter window
        (one ``posix_fadvise`` per 32 MiB or per large payload, not per item)."""
        if end <= self._advised:
            return
        stop = min(self.size, max(end, self._advised + WINDOW // 4))
        _advise(self.fd, self._advised, stop - self._advised)
        self._advised = stop

    def _in_memory(self, offset: int, n: int) -> memoryview | None:
        start = offset - self._held_at
        if self._held_n and start >= 0 and start + n <= self._held_n:
            return memoryview(self._held)[start : start + n]
        return None

    def _hash(self, view: memoryview) -> None:
        t0 = time.perf_counter()
        self.crc = crc32(view, self.crc)
        self.stats.checksum_s += time.perf_counter() - t0


def _after(views: list[memoryview], skip: int) -> list[memoryview]:
    """``views`` without their first ``skip`` bytes."""
    out = []
    for view in views:
        if skip >= view.nbytes:
            skip -= view.nbytes
            continue
        out.append(view[skip:])
        skip = 0
    return out
