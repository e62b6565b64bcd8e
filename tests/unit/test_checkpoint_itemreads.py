"""Reading a checkpoint file item by item ([Note: reading an owned file]): an owner
hashes every byte in order with one read per item, others read only their slices."""

from __future__ import annotations

import itertools
import os
import random
import zlib
from pathlib import Path

import pytest

from fsdpkit.checkpoint import itemreads
from fsdpkit.checkpoint.itemreads import TAIL, ItemFile, LoadStats, read_ahead


def _items(tmp_path: Path, *, gaps: list[int]) -> tuple[Path, bytes, list[tuple[int, int]]]:
    """A file of items, each a zip-like header, a payload and a trailer, the trailer
    and next header ``gap`` bytes in all: (path, bytes, [(payload offset, length)])."""
    rng = random.Random(0)
    data, spans = bytearray(), []
    for gap in gaps:
        data += rng.randbytes(gap)
        n = rng.randrange(1, 200_000)
        spans.append((len(data), n))
        data += rng.randbytes(n)
    data += rng.randbytes(1000)  # the last item's trailer
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(bytes(data))
    return path, bytes(data), spans


def _load(f: ItemFile, spans: list[tuple[int, int]], head: int) -> list[bytes]:
    """The reader's order: ``HEAD`` bytes from ``head`` before the payload (they run
    into it, as ``records.tensor_record``'s do), then the payload."""
    out = []
    for start, n in spans:
        f.pread(start - head, min(4096, f.size - start + head))
        buf = bytearray(n)
        f.take(memoryview(buf), start)
        out.append(bytes(buf))
    return out


def test_an_owner_hashes_every_byte_with_one_read_per_item(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data, spans = _items(tmp_path, gaps=[700, 1900, 1650, 4096, 1700])
    reads = []
    real = os.preadv
    monkeypatch.setattr(
        os, "preadv", lambda fd, views, off: reads.append(off) or real(fd, views, off)
    )
    stats = LoadStats()
    f = ItemFile(path, owned=True, stats=stats)
    loaded = _load(f, spans, head=700)
    f.skip_to(len(data))
    f.close()
    assert loaded == [data[s : s + n] for s, n in spans]
    assert f.crc == zlib.crc32(data)
    assert len(reads) == len(spans) + 1  # the first head; then each payload with what follows
    assert len(data) <= stats.bytes <= len(data) + len(spans) * TAIL  # tails run into payloads


def test_an_owner_reads_what_the_tail_does_not_hold(tmp_path: Path) -> None:
    path, data, spans = _items(tmp_path, gaps=[100, TAIL + 5000, 300])
    f = ItemFile(path, owned=True, stats=LoadStats())
    loaded = _load(f, spans, head=50)
    f.skip_to(len(data))
    f.close()
    assert loaded == [data[s : s + n] for s, n in spans]
    assert f.crc == zlib.crc32(data)


def test_a_short_file_is_named(tmp_path: Path) -> None:
    path, data, spans = _items(tmp_path, gaps=[700, 700])
    f = ItemFile(path, owned=True, stats=LoadStats())
    _load(f, spans, head=600)
    with pytest.raises(EOFError, match=r"__0_0\.distcp ends"):
        f.skip_to(len(data) + 10)
    f.close()
    g = ItemFile(path, owned=False, stats=LoadStats())
    with pytest.raises(EOFError, match=r"__0_0\.distcp ends"):
        g.take(memoryview(bytearray(100)), len(data) - 50)
    g.close()


def test_others_read_only_their_slices(tmp_path: Path) -> None:
    path, data, spans = _items(tmp_path, gaps=[700, 900])
    stats = LoadStats()
    f = ItemFile(path, owned=False, stats=stats)
    start, n = spans[1]
    assert f.pread(start - 10, 10) == data[start - 10 : start]
    buf = bytearray(n // 2)
    f.take(memoryview(buf), start + 3)
    f.close()
    assert bytes(buf) == data[start + 3 : start + 3 + n // 2]
    assert stats.bytes == 10 + n // 2 and f.crc == 0


def test_read_ahead_asks_for_the_files_in_order_within_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = {"a": 3000, "b": 5000, "c": 100}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"x" * size)
    asked = []
    monkeypatch.setattr(
        itemreads.os, "posix_fadvise", lambda fd, off, n, advice: asked.append((off, n, advice))
    )
    read_ahead([tmp_path / "a", tmp_path / "missing", tmp_path / "b", tmp_path / "c"], budget=4000)
    assert asked == [(0, 3000, os.POSIX_FADV_WILLNEED), (0, 1000, os.POSIX_FADV_WILLNEED)]


def test_an_owner_keeps_the_kernel_reading_a_window_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data, spans = _items(tmp_path, gaps=[700, 1600, 1600, 1600, 1600])
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(itemreads, "WINDOW", 64 << 10)
    monkeypatch.setattr(itemreads.os, "posix_fadvise", lambda fd, off, n, _: asked.append((off, n)))
    f = ItemFile(path, owned=True, stats=LoadStats())
    for start, n in spans:
        f.take(memoryview(bytearray(n)), start)
        advised = asked[-1][0] + asked[-1][1]
        assert advised >= min(len(data), start + n + (64 << 10))  # a window past each read
    f.close()
    assert asked[0][0] == 0 and advised == len(data)
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(asked))  # in order
    assert all(n >= 16 << 10 for _, n in asked[:-1])  # a quarter window at least
