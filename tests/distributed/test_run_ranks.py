"""fsdpkit.testing.run_ranks: ranks forked from the forkserver see what spawned ranks
would (the caller's environment, working directory and sys.path at the call, not the
server's from its first call), and a failing rank's traceback is the error raised."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from fsdpkit.testing import RankFailure, run_ranks

pytestmark = pytest.mark.distributed


def _seen(rank: int, world: int) -> tuple[int, str | None, str, bool]:
    """(sum of the ranks over the process group, the probe variable, the working
    directory, whether the probe path is importable from)."""
    import torch.distributed as dist

    gathered: list[int] = [0] * world
    dist.all_gather_object(gathered, rank)
    probe = os.environ.get("FSDPKIT_RUN_RANKS_PROBE")
    return sum(gathered), probe, os.getcwd(), "/run-ranks-probe" in sys.path


def _fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one says no")


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ranks_see_the_callers_state_at_the_call(
    start_method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_ranks(_seen, world_size=2, start_method=start_method)  # type: ignore[arg-type]
    monkeypatch.setenv("FSDPKIT_RUN_RANKS_PROBE", "after-the-server-started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("/run-ranks-probe")
    got = run_ranks(_seen, world_size=2, start_method=start_method)  # type: ignore[arg-type]
    want = (1, "after-the-server-started", str(tmp_path), True)
    assert got == [want, want]


def test_a_failing_rank_is_named_with_its_traceback() -> None:
    with pytest.raises(RankFailure, match=r"rank 1 failed:(.|\n)*rank one says no"):
        run_ranks(_fails, world_size=2, timeout_s=60)
