"""Retention policy ([Note: retention]): which complete checkpoints are deleted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdpkit.checkpoint import Checkpointer, steps_to_delete
from fsdpkit.checkpoint.layout import list_entries
from fsdpkit.config import CheckpointConfig


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


def test_a_dropped_checkpoint_is_incomplete_at_once_and_removed_in_the_background(
    tmp_path: Path,
) -> None:
    """[Note: retention in the background]: when save() returns, the dropped checkpoint
    is gone or renamed step-N.deleting (never complete); close() finishes the removal;
    a .deleting directory left by a process that died is removed by the next save."""
    saver = Checkpointer(run_dir=tmp_path, cfg=CheckpointConfig(keep=1), run_meta={})
    state = {"t": {"w": torch.arange(1000.0)}}
    saver.save(1, state, blocking=True)
    saver.save(2, state, blocking=True)
    names = {e.path.name: e.complete for e in list_entries(tmp_path)}
    assert [n for n, done in names.items() if done] == ["step-00000002"]
    assert set(names) <= {"step-00000002", "step-00000001.deleting"}
    saver.close()
    assert [e.path.name for e in list_entries(tmp_path)] == ["step-00000002"]
    died = tmp_path / "checkpoints" / "step-00000001.deleting"
    died.mkdir()
    (died / "__0_0.distcp").write_bytes(b"x")
    saver.save(3, state, blocking=True)
    saver.close()
    assert [e.path.name for e in list_entries(tmp_path)] == ["step-00000003"]
    restored = {"t": {"w": torch.zeros(1000)}}
    assert Checkpointer(run_dir=tmp_path, cfg=CheckpointConfig(), run_meta={}).resume(restored) == 3
    assert torch.equal(restored["t"]["w"], state["t"]["w"])
