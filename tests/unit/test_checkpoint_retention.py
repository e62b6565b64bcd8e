"""Retention policy ([Note: retention]): which complete checkpoints are deleted, and
their removal off the save's path ([Note: retention in the background])."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdpkit.checkpoint import Checkpointer, list_entries, steps_to_delete
from fsdpkit.checkpoint.trash import set_aside, trash_dir
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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dropped_checkpoints_leave_the_listing_at_once_and_the_disk_by_close(
    tmp_path: Path,
) -> None:
    """[Note: retention in the background]: right after save() checkpoints/ holds only
    what retention keeps; the dropped one sits in .checkpoints-deleting/ until the
    thread (joined by wait / the next save / close) has removed it; what a dead process
    left there goes with the next retention."""
    leftover = trash_dir(tmp_path / "checkpoints") / "step-00000001.dead"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"x" * 1024)
    state = {"w": torch.arange(1024, dtype=torch.float32)}
    saver = Checkpointer(run_dir=tmp_path, cfg=CheckpointConfig(keep=1), run_meta={})
    for step in (2, 3, 4):
        saver.save(step, state, blocking=True)
        names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
        assert names == [f"step-{step:08d}"]
    saver.close()
    assert not trash_dir(tmp_path / "checkpoints").exists()
    assert [e.step for e in list_entries(tmp_path)] == [4]


def test_a_checkpoint_that_cannot_be_set_aside_is_removed_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoints"
    step = root / "step-00000001"
    step.mkdir(parents=True)
    monkeypatch.setattr(Path, "rename", lambda *_: (_ for _ in ()).throw(OSError(18, "EXDEV")))
    assert not set_aside(step, root=root)
    assert step.is_dir()  # the caller removes it where it is
