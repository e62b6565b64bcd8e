"""Retention policy ([Note: retention]): which complete checkpoints are deleted."""

from __future__ import annotations

import pytest

from fsdpkit.checkpoint import steps_to_delete


@pytest.mark.parametrize(
    ("steps", "keep", "keep_every", "deleted"),
    [
        ([], 2, 0, []),
        ([10], 2, 0, []),
        ([10, 20, 30], 2, 0, [10]),
        ([10, 20, 30, 40], 1, 0, [10, 20, 30]),
        ([10, 20, 30, 40, 50], 2, 20, [10, 30]),
        ([5, 10, 15, 20, 25], 1, 10, [5, 15]),
        ([30, 10, 20], 2, 0, [10]),  # order of input does not matter
        ([10, 10, 20], 1, 0, [10]),  # duplicates counted once
        ([0, 7, 14], 1, 7, []),  # step 0 is a multiple of everything
    ],
)
def test_steps_to_delete(steps: list[int], keep: int, keep_every: int, deleted: list[int]) -> None:
    assert steps_to_delete(steps, keep=keep, keep_every=keep_every) == deleted


def test_newest_complete_is_never_deleted() -> None:
    # keep must be >= 1 by config validation; even a bogus 0 keeps the newest.
    assert steps_to_delete([1, 2, 3], keep=0, keep_every=0) == [1, 2]


def test_sequence_of_saves_keeps_policy() -> None:
    """Retention applied after every save, as the Checkpointer does."""
    on_disk: list[int] = []
    for step in range(100, 1100, 100):
        on_disk.append(step)
        for s in steps_to_delete(on_disk, keep=3, keep_every=500):
            on_disk.remove(s)
    assert on_disk == [500, 800, 900, 1000]
