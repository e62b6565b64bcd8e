"""SFT row layout built window by window ([Note: layout in windows]) is the layout of
the whole array at once, in memory and written to a file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fsdpkit.data.layout import Layout, build_layout
from fsdpkit.data.stream import DocEnds, TokenStream


def _examples(n: int, *, seed: int, length: int) -> tuple[TokenStream, DocEnds, np.ndarray]:
    """``n`` examples of 0..2*length tokens, some without answer tokens, some long."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 2 * length, size=n)
    masks = [(rng.random(k) < 0.5).astype(np.uint8) for k in lengths]
    for i in rng.choice(n, size=n // 10, replace=False):
        masks[i][:] = 0  # no answer: dropped, and a row never spans it
    mask = TokenStream([np.concatenate(masks)])
    ends = DocEnds([np.cumsum(lengths).astype(np.int64)], [0])
    answers = np.asarray([int(m.sum()) for m in masks], dtype=np.int64)
    return mask, ends, answers


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("window", [9, 17, 50, 1000])
def test_windowed_layout_equals_the_whole_array_layout(packed: bool, window: int) -> None:
    length = 8
    mask, ends, answers = _examples(400, seed=window, length=length)
    table = lambda lo, hi: answers[lo:hi]  # noqa: E731
    whole = build_layout(mask, ends, table, length=length, packed=packed, window=10**6)
    parts = build_layout(mask, ends, table, length=length, packed=packed, window=window)
    np.testing.assert_array_equal(parts.rows, whole.rows)
    assert parts.stats == whole.stats
    assert whole.stats.truncated > 0 and whole.stats.dropped > 0
    assert whole.stats.rows == len(whole.rows)
    covered = whole.stats.examples + whole.stats.dropped
    assert covered == len(answers)  # every example counted once, whatever the window


def test_rows_are_contiguous_and_within_the_row_length() -> None:
    length = 8
    mask, ends, answers = _examples(300, seed=3, length=length)
    rows = build_layout(
        mask, ends, lambda lo, hi: answers[lo:hi], length=length, packed=True, window=13
    ).rows
    starts, sizes = rows[:, 0], rows[:, 1]
    assert (sizes <= length).all() and (sizes > 0).all()
    assert (np.diff(starts) >= sizes[:-1]).all()  # in order, never overlapping


def test_layout_written_to_a_file_maps_back_and_leaves_no_temporaries(tmp_path: Path) -> None:
    length = 8
    mask, ends, answers = _examples(200, seed=5, length=length)
    table = lambda lo, hi: answers[lo:hi]  # noqa: E731
    out = tmp_path / "layout-x.rows"
    saved = build_layout(mask, ends, table, length=length, packed=True, out=out, window=11)
    memory = build_layout(mask, ends, table, length=length, packed=True)
    assert isinstance(saved.rows, np.memmap)
    np.testing.assert_array_equal(saved.rows, memory.rows)
    assert Layout.load(out) is not None and Layout.load(out).stats == memory.stats  # type: ignore[union-attr]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layout-x.json", "layout-x.rows"]
    out.write_bytes(out.read_bytes()[:-8])  # a torn file is not a layout
    assert Layout.load(out) is None
