"""Hang triage without fsdpkit's launcher (torchrun, SLURM): each rank reports itself.

Two gloo ranks with probes and no control directory: rank 1 falls asleep after its
first step while rank 0 waits in an all-reduce. After ``hang_timeout_s`` without
progress each rank's own triage thread writes ``RUN_DIR/hang/rank-R.txt``: its phase,
its flight recorder (rank 0's newest collective is the all-reduce it waits in) and
every thread's stack (rank 1's main thread in the sleeping function)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fsdpkit.runtime.hangs.flight import BUFFER_ENTRIES
from fsdpkit.testing import run_ranks

pytestmark = pytest.mark.distributed

STALL_S = 1.0


def _asleep_after_the_first_step(hang_dir: Path, *, limit_s: float) -> None:
    """Asleep until both ranks' reports hold their stacks (bounded): on a loaded
    machine a fixed nap could end before a triage thread got the CPU to write."""
    deadline = time.monotonic() + limit_s
    reports = [hang_dir / f"rank-{r}.txt" for r in (0, 1)]
    while time.monotonic() < deadline:
        if all(p.exists() and "most recent call first" in p.read_text() for p in reports):
            time.sleep(0.5)  # the rest of the stacks
            return
        time.sleep(0.1)


def _ranks(rank: int, world_size: int, run_dir: str) -> str:
    import torch
    import torch.distributed as dist

    from fsdpkit.runtime.hangs import HangProbe

    probe = HangProbe.start(
        rank=rank, run_dir=Path(run_dir), control=None, timeout_s=60, hang_timeout_s=STALL_S
    )
    t = torch.ones(256)
    probe.phase("data")
    dist.all_reduce(t)
    probe.step_done(1)  # from here a stall is a hang
    probe.phase("data")
    if rank == 1:
        _asleep_after_the_first_step(Path(run_dir) / "hang", limit_s=60)
    dist.all_reduce(t)  # rank 0 waits here for rank 1
    probe.phase("finish")
    probe.close()
    report = Path(run_dir) / "hang" / f"rank-{rank}.txt"
    return report.read_text() if report.exists() else ""


def test_each_rank_reports_itself_without_a_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", str(BUFFER_ENTRIES))  # before the process group
    rank0, rank1 = run_ranks(_ranks, world_size=2, args=(str(tmp_path),), timeout_s=120)
    assert "trigger: no progress for 1 s" in rank0, rank0
    assert "where: data of step 2" in rank0
    assert "collectives issued: group 0 (ranks [0, 1]): 2" in rank0
    assert "#2 gloo:all_reduce on group 0 (default_pg): [256] Float, 1.0 KiB" in rank0
    assert "not completed" in rank0.split("last collectives")[1].splitlines()[1]
    assert "collectives issued: group 0 (ranks [0, 1]): 1" in rank1, rank1
    assert "in _asleep_after_the_first_step\n" in rank1.split("Python stacks")[1]
