"""Hang triage's pure parts: the progress record, the loop's phase marks, the flight
recorder summary, which rank is behind, and reading faulthandler's dump."""

from __future__ import annotations

import faulthandler
import io
import os
import pickle
import threading
import time
from pathlib import Path

import pytest

from fsdpkit.errors import ConfigError
from fsdpkit.run.resolve import resolve
from fsdpkit.runtime.hangs import HangProbe, HangWatch, hang_timeout
from fsdpkit.runtime.hangs.behind import RankView, judge, main_thread_frames, paragraph
from fsdpkit.runtime.hangs.flight import FlightSummary, _PlainUnpickler, summarize
from fsdpkit.runtime.hangs.probe import is_timeout
from fsdpkit.runtime.hangs.record import Record, Snapshot


def test_record_is_shared_through_its_file_and_a_restart_is_a_new_inode(tmp_path: Path) -> None:
    path = tmp_path / "progress-rank-3"
    writer = Record.create(path, rank=3)
    reader = Record.open(path)
    assert reader is not None
    snap = reader.read()
    assert (snap.rank, snap.pid, snap.phase, snap.armed) == (3, os.getpid(), "setup", False)
    assert snap.main_thread == threading.main_thread().ident
    before = time.monotonic()
    writer.write(step=7, phase="backward", micro=2, armed=True)
    after = time.monotonic()
    snap = reader.read()
    assert (snap.step, snap.phase, snap.micro, snap.armed) == (7, "backward", 2, True)
    assert before <= snap.since <= after  # stamped by the write, on the monotonic clock
    reader.set_flag("request", 4)
    writer.set_flag("answered", 4)
    assert (writer.read().request, reader.read().answered) == (4, 4)
    again = Record.create(path, rank=3)  # a restarted worker
    assert Record.open(path).inode != reader.inode  # type: ignore[union-attr]
    assert reader.read().step == 7  # the old mapping stays readable
    assert Record.open(tmp_path / "missing") is None
    for r in (writer, reader, again):
        r.close()


def test_marks_follow_a_step_and_order_ranks_by_how_far_they_got() -> None:
    probe = HangProbe.off()
    seen: list[Snapshot] = []

    def note() -> None:
        seen.append(probe.record.read())

    probe.phase("data")
    note()
    mark = probe.marker(2)
    note()
    for ended in ("forward", "backward", "forward", "backward"):
        mark(ended)
        note()
    mark("optimizer step")
    probe.step_done(1)
    note()
    wheres = [s.where() for s in seen]
    assert wheres == [
        "data of step 1",
        "forward (micro-batch 0) of step 1",
        "backward (micro-batch 0) of step 1",
        "forward (micro-batch 1) of step 1",
        "backward (micro-batch 1) of step 1",
        "optimizer of step 1",
        "metrics after step 1",
    ]
    orders = [s.order for s in seen]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)
    assert not seen[0].armed and seen[-1].armed


def _entry(seq: int, op: str, *, group: str = "0", retired: bool = True, n: int = 256) -> dict:
    return {
        "record_id": seq,
        "collective_seq_id": seq,
        "profiling_name": op,
        "process_group": (group, "default_pg"),
        "input_sizes": [[n]],
        "input_dtypes": ["BFloat16"],
        "state": "scheduled",
        "retired": retired,
        "time_created_ns": time.time_ns() - 2_000_000_000,
        "frames": [{"filename": "/x/fsdp.py", "line": 9, "name": "unshard"}],
        "is_p2p": False,
    }


def _flight(last: int, *, retired_last: bool) -> FlightSummary:
    entries = [_entry(i, "nccl:all_gather") for i in range(1, last)]
    entries.append(_entry(last, "nccl:all_gather", retired=retired_last, n=1024))
    return summarize({"entries": entries}, groups={"0": [0, 1, 2]})


def test_flight_summary_counts_per_group_and_sizes_the_newest() -> None:
    summary = _flight(12, retired_last=False)
    assert summary.issued == {"0": 12} and summary.groups == {"0": [0, 1, 2]}
    last = summary.last
    assert last is not None and len(summary.recent) == 8
    assert (last.seq, last.bytes, last.state, last.frames) == (
        12,
        2048,
        "not completed",
        ["/x/fsdp.py:9 in unshard"],
    )
    assert summary.recent[1].state == "completed" and 1.5 < last.age_s < 60
    assert "#12 nccl:all_gather on group 0 (default_pg): [1024] BFloat16, 2.0 KiB" in (
        last.describe()
    )
    assert summary.timed_out().recent[0].state == "timed out"
    assert FlightSummary.from_json(summary.to_json()) == summary


def test_a_flight_dump_that_asks_for_a_global_is_refused() -> None:
    evil = pickle.dumps({"entries": [os.system]})
    with pytest.raises(pickle.UnpicklingError, match=r"posix\.system"):
        _PlainUnpickler(io.BytesIO(evil)).load()


def _snap(rank: int, *, step: int, phase: str, micro: int = 0) -> Snapshot:
    return Snapshot(
        rank=rank,
        pid=100 + rank,
        main_thread=0x10 + rank,
        started=0.0,
        step=step,
        phase=phase,
        micro=micro,
        armed=True,
        timed_out=False,
        since=0.0,
        request=0,
        answered=0,
        triaged=0,
    )


STACKS = """Thread 0x0000000000000099 (most recent call first):
  File "/t/threading.py", line 331 in wait

Current thread 0x0000000000000011 (most recent call first):
  File "/home/u/proj/train/model.py", line 40 in slow_layer
  File "/home/u/proj/train/loop.py", line 9 in step
"""


def test_the_rank_that_issued_fewer_collectives_is_behind_and_named_with_its_frame() -> None:
    views = [
        RankView(_snap(0, step=4, phase="forward"), 9.5, flight=_flight(30, retired_last=False)),
        RankView(
            _snap(1, step=4, phase="forward"),
            9.5,
            stacks=STACKS,
            flight=_flight(29, retired_last=True),
        ),
        RankView(_snap(2, step=4, phase="forward"), 9.5, flight=_flight(30, retired_last=False)),
    ]
    verdict = judge(views)
    assert verdict.behind == [1]
    text = paragraph(verdict, trigger="no rank made progress", report=Path("/r/hang/report.txt"))
    assert "Rank 1 is behind: it is in forward (micro-batch 0) of step 5 for 9.5 s" in text
    assert "at proj/train/model.py:40 in slow_layer, 29 collectives issued" in text
    assert "rank 0 waits in collective #30 nccl:all_gather (2.0 KiB, group 0 default_pg" in text
    assert "which rank 1 (its last there is #29) has not issued" in text
    assert text.endswith("Python stacks: /r/hang/report.txt.")


def test_phase_decides_before_collectives_and_equal_ranks_mean_nobody_is_behind() -> None:
    ahead = RankView(_snap(0, step=5, phase="data"), 3.0, flight=_flight(10, retired_last=True))
    late = RankView(_snap(1, step=4, phase="optimizer"), 3.0, flight=_flight(40, retired_last=True))
    assert judge([ahead, late]).behind == [1]
    same = [
        RankView(_snap(r, step=2, phase="backward"), 1.0, flight=_flight(8, retired_last=False))
        for r in range(2)
    ]
    verdict = judge(same)
    assert verdict.behind == []
    text = paragraph(verdict, trigger="t", report=Path("r.txt"))
    assert "No rank is behind" in text and "network or the backend" in text


def test_main_thread_frames_from_a_real_faulthandler_dump(tmp_path: Path) -> None:
    assert main_thread_frames(STACKS, 0x11) == [
        "/home/u/proj/train/model.py:40 in slow_layer",
        "/home/u/proj/train/loop.py:9 in step",
    ]
    path = tmp_path / "stacks.txt"
    with path.open("w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
    frames = main_thread_frames(path.read_text(), threading.main_thread().ident or 0)
    assert frames and "test_main_thread_frames_from_a_real_faulthandler_dump" in frames[0]


def test_timeouts_and_the_default_stall_limit() -> None:
    gloo = RuntimeError("[gloo/unbound_buffer.cc:81] Timed out waiting 10000ms for recv")
    wrapped = RuntimeError("step 3 failed")
    wrapped.__cause__ = gloo
    assert is_timeout(wrapped) and not is_timeout(RuntimeError("Connection reset by peer"))
    assert hang_timeout(600.0, None) == 540.0 and hang_timeout(600.0, 0) == 0
    cfg = resolve(None, ["parallel.timeout_s=100"], world_size=2, local_world_size=2).config
    assert cfg.parallel.hang_timeout_s is None
    with pytest.raises(ConfigError, match=r"parallel\.hang_timeout_s must be >= 0"):
        resolve(None, ["parallel.hang_timeout_s=-1"], world_size=2, local_world_size=2)


def test_nccl_watchdog_dumps_become_the_same_report_after_the_ranks_died(tmp_path: Path) -> None:
    """NCCL's watchdog dumps every rank's recorder on a timeout and aborts the process
    before Python can say anything: the launcher reports from the dumps and records."""
    control, run_dir = tmp_path / "control", tmp_path / "run"
    control.mkdir()
    flight_dir = run_dir / "hang" / "flight-recorder"
    flight_dir.mkdir(parents=True)
    for rank, last in ((0, 30), (1, 29)):
        record = Record.create(control / f"progress-rank-{rank}", rank=rank)
        record.write(step=4, phase="forward", micro=0, armed=True)
        entries = [_entry(i, "nccl:all_gather") for i in range(1, last + 1)]
        entries[-1]["retired"] = rank == 1
        config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
        dump = {"version": "2.10", "pg_config": config, "entries": entries}
        (flight_dir / f"rank_{rank}").write_bytes(pickle.dumps(dump))
    with HangWatch(control=control, run_dir=run_dir, nproc=2, stall_s=0, timeout_s=600) as w:
        report = w.post_mortem()
    assert report is not None and report.behind == [1]
    assert report.message.startswith(
        "the run hung: NCCL's watchdog saw a collective time out (parallel.timeout_s = 600) "
        "and dumped the flight recorders of ranks [0, 1]. Rank 1 is behind"
    )
    assert "which rank 1 (its last there is #29) has not issued" in report.message
    text = report.path.read_text()
    assert "collectives issued: group 0 (ranks [0, 1]): 30" in text
    assert "(none: the process did not answer SIGUSR2 in time, or was already gone)" in text
