"""Why a run failed, said once ([Note: root cause] in fsdpkit.runtime.failures): the first
real error of the last attempt, else the rank a signal killed (and whether the OOM
killer did it), else the earliest lost-peer error."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from fsdpkit.runtime import failures
from fsdpkit.runtime.failures import root_cause


def _record(directory: Path, *, rank: int, attempt: int, time: float, message: str) -> None:
    record = {"rank": rank, "attempt": attempt, "time": time, "user": False, "message": message}
    (directory / f"rank-{rank}-attempt-{attempt}.json").write_text(json.dumps(record))


def test_root_cause_is_the_first_primary_error_of_the_last_attempt(tmp_path: Path) -> None:
    assert root_cause(tmp_path) is None
    _record(tmp_path, rank=0, attempt=0, time=1.0, message="ValueError: bad batch")
    _record(tmp_path, rank=1, attempt=1, time=5.0, message="Connection reset by peer")
    _record(tmp_path, rank=0, attempt=1, time=6.0, message="RuntimeError: shape mismatch")
    _record(tmp_path, rank=2, attempt=1, time=7.0, message="KeyError: 'x'")
    (tmp_path / "rank-3-attempt-1.json").write_text("{torn")  # skipped, not fatal
    cause = root_cause(tmp_path)
    assert cause is not None and cause["rank"] == 0 and "shape mismatch" in str(cause["message"])


def test_root_cause_falls_back_to_the_earliest_secondary_error(tmp_path: Path) -> None:
    _record(tmp_path, rank=1, attempt=0, time=2.0, message="gloo: connection closed by peer")
    _record(tmp_path, rank=0, attempt=0, time=1.0, message="Socket Timeout")
    cause = root_cause(tmp_path)
    assert cause is not None and cause["rank"] == 0


def test_a_signal_death_is_the_root_cause_and_oom_counters_are_read(tmp_path: Path) -> None:
    fail = lambda pid, code, t: SimpleNamespace(pid=pid, exitcode=code, timestamp=t)  # noqa: E731
    deaths = failures.signal_deaths({0: fail(10, 1, 5), 1: fail(11, -9, 3), 2: fail(12, -11, 4)})
    assert [(d.rank, d.signum) for d in deaths] == [(1, 9), (2, 11)]
    text = failures.describe_signal_death(deaths[0], oom=["/proc/vmstat: 3 -> 4"])
    assert "rank 1 (pid 11) was killed by SIGKILL" in text and "OOM killer ran" in text
    assert "native code" in failures.describe_signal_death(deaths[1], oom=[])
    before = failures.OomCounters({"/proc/vmstat": 3, "x": 1})
    assert failures.OomCounters({"/proc/vmstat": 4, "x": 1}).rose_since(before) == [
        "/proc/vmstat: 3 -> 4"
    ]
    assert "/proc/vmstat" in failures.OomCounters.read().counts
    assert failures.is_secondary("RuntimeError: Connection reset by peer")
    assert "no complete checkpoint" in failures.newest_checkpoint_note(tmp_path)


def test_a_node_lost_is_named_by_the_peer_address_gloo_gives() -> None:
    """[Note: lost node]: rank 0's only error was its peer on node 1 going away."""
    message = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
        "closed by peer [10.213.118.2]:35557. This is typically caused by a remote worker "
        "crashing.\n\nTraceback (most recent call last): ..."
    )
    said = failures.describe_lost_node(message, local_ranks=[0, 1], world_size=4)
    assert said.startswith("lost the node at 10.213.118.2 (ranks 2, 3):"), said
    assert "connection closed by peer 10.213.118.2:35557" in said and "Traceback" not in said
    vague = failures.describe_lost_node("Connection reset", local_ranks=[0], world_size=2)
    assert vague.startswith("lost another node of the job (ranks 1)"), vague
