"""DCP's file-system writer, checksumming every byte as it is written.

[Note: one pass over the bytes]
``ChecksumWriter`` is DCP's ``FileSystemWriter`` (same files, same format: plain
``dcp.load`` reads them) whose streams crc32 what passes through ``write``, so the
commit gets each file's size and crc32 without reading anything back. Three more
things make a save run at the disk's speed (bench/checkpoint_io.py, docs/checkpoints.md):

- ``torch.save`` normally crc32s every tensor it serializes for its zip container (a
  second pass at ~4 GB/s); that is switched off while DCP writes, since our stream
  checksum covers the same bytes.
- write-behind: after every ``WRITE_BEHIND`` bytes the stream asks the kernel to start
  writing them out (``posix_fadvise(DONTNEED)`` starts writeback of dirty pages
  without waiting), so the disk works while DCP serializes the next tensors and the
  final fsync only waits for the tail.
- the stream itself fsyncs on close (DCP's own ``sync_files`` is off): every data file
  and ``.metadata`` is durable before ``dcp.save`` returns, which is what step 4 of
  [Note: save protocol] (marker written last, then the rename) relies on.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.futures import Future

from fsdpkit.checkpoint.checksum import crc32, hex32

WRITE_BEHIND = 64 << 20
"""Bytes after which a stream starts writeback of what it wrote so far."""
_TIMED = 64 << 10
"""Writes at least this large are timed (``WriteStats``); smaller ones only counted."""


@dataclass
class WriteStats:
    """Seconds spent in each part of writing (summed over DCP's writer threads; times
    cover the tensor payloads, not the few bytes of headers between them)."""

    bytes: int = 0
    write_s: float = 0.0
    checksum_s: float = 0.0
    fsync_s: float = 0.0

    def add(self, other: WriteStats) -> None:
        self.bytes += other.bytes
        self.write_s += other.write_s
        self.checksum_s += other.checksum_s
        self.fsync_s += other.fsync_s


class _HashingStream(io.RawIOBase):
    """A binary file opened for writing that crc32s and counts what it is given."""

    def __init__(self, path: Path, *, on_close: Any) -> None:
        super().__init__()
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._fd = self._file.fileno()
        self._path = path
        self._on_close = on_close
        self._crc = 0
        self._advised = 0
        self.stats = WriteStats()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = b if isinstance(b, bytes) else memoryview(b).cast("B")
        n = len(view)
        if n < _TIMED:  # torch.save's headers: ~40 small writes per tensor, keep them cheap
            self._crc = crc32(view, self._crc)
            self._file.write(view)
            self.stats.bytes += n
            return n
        t0 = time.perf_counter()
        self._crc = crc32(view, self._crc)
        t1 = time.perf_counter()
        self._file.write(view)
        self.stats.bytes += n
        self.stats.checksum_s += t1 - t0
        self.stats.write_s += time.perf_counter() - t1
        if self.stats.bytes - self._advised >= WRITE_BEHIND:
            self._write_behind()
        return n

    def _write_behind(self) -> None:
        self._file.flush()
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, self._advised, 0, os.POSIX_FADV_DONTNEED)
        self._advised = self.stats.bytes

    def tell(self) -> int:
        return self.stats.bytes

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Flush, fsync, close, and report (name, size, crc32): the file is durable."""
        if self.closed:
            return
        self._file.flush()
        t0 = time.perf_counter()
        os.fsync(self._fd)
        self.stats.fsync_s += time.perf_counter() - t0
        super().close()
        self._file.close()
        self._on_close(self._path.name, {"bytes": self.stats.bytes, "crc32": hex32(self._crc)})

    def abort(self) -> None:
        """Close without fsync or report (the save failed; the directory is removed)."""
        if not self.closed:
            self._file.close()
            self._on_close = None
            io.RawIOBase.close(self)


class _HashingFileSystem(FileSystem):
    def __init__(self, owner: ChecksumWriter) -> None:
        self._owner = owner

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = _HashingStream(Path(path), on_close=self._owner._record)
        try:
            yield stream
            stream.close()
        except BaseException:
            stream.abort()
            raise
        finally:
            self._owner._add_stats(stream.stats)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        self._owner._renamed(Path(path).name, Path(new_path).name)


class ChecksumWriter(FileSystemWriter):
    """``FileSystemWriter`` that records ``{file name: {"bytes", "crc32"}}`` of every file
    it writes in ``records`` ([Note: one pass over the bytes]).

    One per save: ``records`` and ``stats`` describe that save only."""

    def __init__(self, path: str | os.PathLike, *, thread_count: int = 1) -> None:
        super().__init__(
            path,
            single_file_per_rank=True,
            sync_files=False,  # the streams fsync themselves on close
            thread_count=thread_count,
            overwrite=True,
        )
        self.fs = _HashingFileSystem(self)
        self.records: dict[str, dict[str, Any]] = {}
        self.stats = WriteStats()
        self._lock = threading.Lock()

    def _record(self, name: str, record: dict[str, Any]) -> None:
        with self._lock:
            self.records[name] = record

    def _renamed(self, old: str, new: str) -> None:
        with self._lock:
            if old in self.records:
                self.records[new] = self.records.pop(old)

    def _add_stats(self, stats: WriteStats) -> None:
        with self._lock:
            self.stats.add(stats)

    def write_data(self, plan: Any, planner: Any) -> Future[Any]:
        # torch.save's own per-record crc32 is a second pass over the same bytes
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            return super().write_data(plan, planner)
        finally:
            torch.serialization.set_crc32_options(previous)
