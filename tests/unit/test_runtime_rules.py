"""The pure rules behind issue 9 (nothing lost, nobody in), without a process group:
the batch split, the loader across world sizes, the resumed LR schedule, SLURM's
variables, the root-cause choice, run-dir writes, the run-dir lock, listeners,
capacity, and the signal handlers (those in a subprocess: they kill or exit)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fsdpkit import netinfo
from fsdpkit.config import ConfigError, TrainConfig, batch_split, load
from fsdpkit.data import PackedLoader
from fsdpkit.planner.recommend import _micro_changes
from fsdpkit.planner.scenario import scenario
from fsdpkit.runtime import failures, slurm
from fsdpkit.runtime.capacity import MIB, Capacity, CapacityError
from fsdpkit.runtime.rundir import RunDirError, append_line, check_run_dir, read_jsonl
from fsdpkit.runtime.runlock import LOCK_FILE, RunDirLocked, acquire
from fsdpkit.train.loop import reapply_schedule
from fsdpkit.trainable.optim import build_scheduler, lr_factor

# --------------------------------------------------------------------- batch split


def test_global_batch_splits_the_same_step_over_any_world_size() -> None:
    train = TrainConfig(global_batch_size=12, micro_batch_size=4)
    splits = {w: batch_split(train, dp_world=w) for w in (1, 2, 3, 4, 6, 12)}
    assert {w: (s.micro_batch, s.grad_accum) for w, s in splits.items()} == {
        1: (4, 3),
        2: (3, 2),
        3: (4, 1),
        4: (3, 1),
        6: (2, 1),
        12: (1, 1),
    }
    assert {s.global_batch for s in splits.values()} == {12}
    unset = batch_split(TrainConfig(micro_batch_size=4, grad_accum=2), dp_world=3)
    assert (unset.global_batch, unset.micro_batch, unset.grad_accum) == (24, 4, 2)


def test_a_global_batch_that_does_not_split_names_the_fix() -> None:
    with pytest.raises(ConfigError) as e:
        batch_split(TrainConfig(global_batch_size=8), dp_world=3)
    assert "train.global_batch_size = 8" in str(e.value) and "1, 2, 4, 8" in str(e.value)
    with pytest.raises(ConfigError, match=r"train\.grad_accum"):
        batch_split(TrainConfig(global_batch_size=8, grad_accum=2), dp_world=2)
    with pytest.raises(ConfigError, match="global_batch_size"):
        load(None, ["train.global_batch_size=0"])


def test_planner_and_recommender_use_the_same_split() -> None:
    cfg = load(None, ["train.global_batch_size=12", "train.micro_batch_size=4"])
    for world in (2, 3, 4):
        sc = scenario(cfg, world_size=world)
        split = batch_split(cfg.train, dp_world=world)
        assert (sc.micro_batch, sc.grad_accum) == (split.micro_batch, split.grad_accum)
    choices = _micro_changes(cfg, world=2)  # per rank 6: caps 1, 2, 3, 6
    assert choices == [{"train.micro_batch_size": m} for m in (1, 2, 3, 6)]


# -------------------------------------------------------------------------- loader

SEQ = 4


def _step_ids(ranks: list[PackedLoader]) -> list[int]:
    """The sorted sequence ids of one optimizer step over all ranks."""
    return sorted(int(s) for r in ranks for b in r.next_step() for s in b[:, 0] // SEQ)


def _ranks(tokens: torch.Tensor, world: int, global_batch: int, cap: int) -> list[PackedLoader]:
    split = batch_split(
        TrainConfig(global_batch_size=global_batch, micro_batch_size=cap), dp_world=world
    )
    return [
        PackedLoader(tokens, seq_len=SEQ, micro_batch_size=split.micro_batch, dp_rank=r,
                     dp_world=world, seed=3, grad_accum=split.grad_accum)
        for r in range(world)
    ]  # fmt: skip


def test_resuming_at_other_world_sizes_takes_the_same_sequences_per_step() -> None:
    tokens = torch.arange(53 * SEQ + 1)  # 53 sequences: 4 steps of 12 per epoch, 5 dropped
    reference = _ranks(tokens, 2, 12, 4)
    expected = [_step_ids(reference) for _ in range(10)]  # crosses two epoch ends
    got, ranks = [], _ranks(tokens, 2, 12, 4)
    for world, steps in ((2, 3), (3, 3), (4, 4)):
        state = ranks[0].state_dict()
        ranks = _ranks(tokens, world, 12, 4)
        for loader in ranks:
            loader.load_state_dict(state)
        got += [_step_ids(ranks) for _ in range(steps)]
    assert got == expected
    first_epoch = [s for step in expected[:4] for s in step]
    assert len(first_epoch) == len(set(first_epoch)) == 48  # none skipped or repeated


# ------------------------------------------------------------- resumed LR schedule


def _resumed(steps_before: int, steps_after: int, at: int) -> tuple[float, float]:
    """(LR the resumed run's first step uses, LR the new schedule gives there)."""
    model = torch.nn.Linear(2, 2)
    old = TrainConfig(steps=steps_before, warmup_steps=2)
    opt = torch.optim.AdamW(model.parameters(), lr=old.lr)
    sched = build_scheduler(opt, old)
    for _ in range(at):
        opt.step()
        sched.step()
    saved = (opt.state_dict(), sched.state_dict())
    new = TrainConfig(steps=steps_after, warmup_steps=2)
    opt2 = torch.optim.AdamW(model.parameters(), lr=new.lr)
    sched2 = build_scheduler(opt2, new)
    opt2.load_state_dict(saved[0])
    sched2.load_state_dict(saved[1])
    session = SimpleNamespace(scheduler=sched2, optimizer=opt2, cfg=SimpleNamespace(train=new))
    reapply_schedule(session)  # type: ignore[arg-type]
    assert sched2.get_last_lr()[0] == opt2.param_groups[0]["lr"]
    return opt2.param_groups[0]["lr"], new.lr * lr_factor(at, new)


def test_a_resume_applies_the_new_schedule_from_its_first_step() -> None:
    used, wanted = _resumed(12, 16, at=12)
    assert used == wanted and used != TrainConfig().lr * lr_factor(12, TrainConfig(steps=12))
    same, _ = _resumed(12, 12, at=7)  # unchanged schedule: bit-identical to not resuming
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=TrainConfig().lr)
    sched = build_scheduler(opt, TrainConfig(steps=12, warmup_steps=2))
    for _ in range(7):
        opt.step()
        sched.step()
    assert same == opt.param_groups[0]["lr"]


# ---------------------------------------------------------------------------- SLURM


def test_slurm_variables_map_to_torch_ones() -> None:
    assert slurm.first_host("gpu[07-09,12],cpu1") == "gpu07" and slurm.first_host("a,b") == "a"
    assert [slurm.tasks_on_node("4(x2),2", n) for n in range(3)] == [4, 4, 2]
    env = {
        "SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
        "SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_NODELIST": "n[3-5]", "SLURM_JOB_ID": "123457",
    }  # fmt: skip
    assert slurm.torch_env(env) == {
        "RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "n3", "MASTER_PORT": "13457",
    }  # fmt: skip
    assert "MASTER_PORT" not in slurm.torch_env({**env, "MASTER_PORT": "999"})
    assert slurm.torch_env({**env, "RANK": "0"}) == {}


# ---------------------------------------------------------------------- root cause


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


# ---------------------------------------------------------------- run-dir writes


def test_run_dir_checks_and_whole_line_writes(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(RunDirError, match="is a regular file"):
        check_run_dir(afile)
    with pytest.raises(RunDirError, match="cannot be created"):
        check_run_dir(afile / "run")
    check_run_dir(tmp_path / "new" / "run")
    assert (tmp_path / "new" / "run").is_dir() and not list((tmp_path / "new" / "run").iterdir())

    full = tmp_path / "metrics.jsonl"
    full.symlink_to("/dev/full")
    with pytest.raises(RunDirError, match="the disk is full"):
        append_line(full, {"step": 1}, what="the metrics file")
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"step": 1}\n{"step": 2, "lo')
    assert read_jsonl(torn) == [{"step": 1}]


# -------------------------------------------------------------------- run-dir lock


def test_one_run_per_run_dir(tmp_path: Path) -> None:
    with acquire(tmp_path):
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        with pytest.raises(RunDirLocked) as e:
            acquire(tmp_path)  # another open file description: flock refuses it
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in str(e.value)
    stale = {**record, "pid": 2**22 + 7, "proc_start": 1}  # a dead process's record
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale))
    with acquire(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # released: record cleared


# ------------------------------------------------------------ listeners, capacity


def test_listeners_are_read_from_proc() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        mine = [lst for lst in netinfo.listeners([os.getpid()]) if lst.port == port]
        assert mine and mine[0].address == "127.0.0.1" and mine[0].loopback_only
        assert netinfo.port_holder(port) == f"pid {os.getpid()} ({netinfo.command_of(os.getpid())})"
    assert netinfo.loopback_interface() == netinfo.interface_of("127.0.0.1") == "lo"


def test_capacity_warns_about_cores_and_refuses_what_memory_cannot_hold() -> None:
    ok = Capacity(nproc=2, slots=2, device="cpu", per_worker=300 * MIB, available=2**33)
    assert ok.warning() is None
    ok.check_memory()
    over = Capacity(nproc=64, slots=2, device="cpu", per_worker=300 * MIB, available=2**34)
    assert "--nproc 64 starts 64 workers on 2 CPU cores" in str(over.warning())
    with pytest.raises(CapacityError) as e:
        over.check_memory()
    assert "18.8 GiB" in str(e.value) and "Use --nproc 54 or fewer" in str(e.value)


# ------------------------------------------------- signals and lifetime (subprocess)


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_stop_flag_records_the_first_signal_and_a_second_exits_at_once() -> None:
    result = _python(
        """
        import os, signal
        from fsdpkit.runtime.signals import install_stop_flag, agreed_signal
        flag = install_stop_flag()
        os.kill(os.getpid(), signal.SIGHUP)
        print(flag.name, agreed_signal(flag.signum), flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        print("not reached")
        """
    )
    assert result.stdout.split() == ["SIGHUP", "1"] and result.returncode == 128 + 2, result


def test_launcher_signals_forward_once_then_kill_the_workers() -> None:
    result = _python(
        """
        import os, signal, subprocess, sys, time
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from fsdpkit.runtime.interrupts import ImmediateStop, LauncherSignals
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                  start_new_session=True)
        with LauncherSignals():
            try:
                os.kill(os.getpid(), signal.SIGINT); time.sleep(5)
            except SignalException as e:
                print("forward", e.sigval.name, flush=True)
            try:
                os.kill(os.getpid(), signal.SIGINT); time.sleep(5)
            except ImmediateStop as e:
                print("immediate", worker.wait(timeout=5), flush=True)
        """
    )
    assert result.stdout.split() == ["forward", "SIGINT", "immediate", "-9"], result


def test_a_worker_dies_with_its_parent_even_without_prctl() -> None:
    """The watchdog alone (prctl disabled): kill -9 the parent, the child follows."""
    result = _python(
        """
        import os, subprocess, sys, time
        child = '''
        import os, sys, time
        from fsdpkit.runtime import lifetime
        lifetime.set_parent_death_signal = lambda sig=9: False   # the fallback only
        lifetime.bind_to_parent(int(sys.argv[1]), interval=0.1)
        print(os.getpid(), flush=True)
        time.sleep(60)
        '''
        parent = subprocess.Popen([sys.executable, "-c",
            "import subprocess, sys, os; subprocess.Popen([sys.executable, '-c', sys.argv[1], "
            "str(os.getpid())]); import time; time.sleep(60)", child], stdout=subprocess.PIPE,
            text=True)
        pid = int(parent.stdout.readline())
        os.kill(parent.pid, 9)
        parent.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            try:  # gone, or a zombie waiting for init to reap it
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                state = "Z"
            if state == "Z":
                print("gone", flush=True)
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
        """,
        timeout=90,
    )
    assert result.stdout.strip() == "gone", result
