"""Nothing lost, nobody in: faults around a run, through the CLI (issue 9).

One test per failure the issue lists (its numbers in the names; 3 and 8 are
checkpoint-trust tests elsewhere). Each failed on the main branch before the fix:
orphaned workers (1), Ctrl-C/SIGHUP saving nothing (2), listeners on every interface
(4), two runs in one directory (5), a busy rendezvous port hanging (6), run-dir and
disk faults as tracebacks (7), binary data trained on (9), --nproc 64 without a word
(10), a killed worker blamed on its peer (11).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from clirun import FAST, children, fsdpkit, start, wait_for_step
from clirun import processes_in as _processes_in

from fsdpkit import netinfo
from fsdpkit.runtime.distenv import ERROR_DIR_VAR
from fsdpkit.runtime.rundir import read_jsonl

pytestmark = pytest.mark.e2e

LONG = [
    *[a for a in FAST if not a.startswith(("train.steps", "checkpoint.resume"))],
    "train.steps=100000",
    "train.eval_every=0",
    "logging.progress=lines",
    "checkpoint.resume=auto",
]
"""A run that goes on until the test stops it."""


def _env_of(pid: int, name: str) -> str:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(v for v in environ if v.startswith(name.encode() + b"=")).split(b"=", 1)[1].decode()


def _rank_of(pid: int) -> int:
    return int(_env_of(pid, "RANK"))


def _steps(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}


def _newest_checkpoint(run_dir: Path) -> int:
    names = [p.name for p in (run_dir / "checkpoints").glob("step-*") if "." not in p.name]
    return max(int(n.split("-")[1]) for n in names)


def test_1_4_5_killed_launcher_takes_its_workers_along_and_nobody_else_gets_in(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    run_dir = tmp_path / "run"
    args = ["train", *LONG, "checkpoint.every=10", f"logging.run_dir={run_dir}"]
    proc = start(*args, cwd=tmp_path)
    launched.append(proc)
    wait_for_step(run_dir, 3, proc)
    workers = children(proc.pid)
    assert len(workers) == 2, workers

    # 4: every listener of the launcher and its workers is on loopback.
    found = netinfo.listeners([proc.pid, *workers])
    assert len(found) >= 3, found  # two stores in the launcher, gloo in the workers
    assert all(lst.loopback_only for lst in found), found

    # 5: a second run into the same directory is refused, naming the holder.
    second = fsdpkit(*args, cwd=tmp_path, timeout=120)
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"pid {proc.pid}" in second.stderr and "in use by another run" in second.stderr
    assert "Traceback" not in second.stderr

    # 1: kill -9 of the launcher's process group; its workers must not survive it.
    control = Path(_env_of(workers[0], ERROR_DIR_VAR))
    seen = wait_for_step(run_dir, 13, proc)
    while seen % 10 in (0, 1, 2):  # kill a few steps past a checkpoint
        seen = wait_for_step(run_dir, seen + 1, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    before_kill = _steps(run_dir)
    deadline = time.monotonic() + 5
    while _processes_in(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_in(run_dir) == [], "workers outlived their launcher"
    assert control.is_dir()  # nobody was left to remove it ...

    # ... and a rerun resumes from the newest complete checkpoint, bit-exactly.
    resume_step = _newest_checkpoint(run_dir)
    overlap = [s for s in before_kill if s > resume_step]
    assert overlap, (resume_step, max(before_kill))
    (run_dir / "metrics.jsonl").unlink()  # the rerun's records alone (kept above)
    launched.append(again := start(*args, cwd=tmp_path))
    out, err = _stop(run_dir, again, signal.SIGINT, after=max(overlap))
    assert again.returncode == 130, err[-3000:]
    assert f"resumed from step {resume_step}" in out
    assert not control.exists()  # ... so the next launch did ([Note: control directory])
    after = _steps(run_dir)
    assert [after[s] for s in overlap] == [before_kill[s] for s in overlap]


def _stop(
    run_dir: Path, proc: subprocess.Popen[str], *signals: int, after: int = 3, lead: float = 0.0
) -> tuple[str, str]:
    """Send ``signals`` ``lead`` seconds after the run logged step ``after``; its output."""
    wait_for_step(run_dir, after, proc)
    time.sleep(lead)
    for i, sig in enumerate(signals):
        time.sleep(0.5 if i else 0)  # two quick signals would merge into one
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return out, err


def test_2_ctrl_c_and_hangup_save_the_current_step_and_a_second_ctrl_c_stops_at_once(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    run_dir = tmp_path / "run"
    args = ["train", *LONG, "checkpoint.every=1000", "model.factory=factories:sluggish"]
    args.append(f"logging.run_dir={run_dir}")
    launched.append(proc := start(*args, cwd=tmp_path))
    out, err = _stop(run_dir, proc, signal.SIGINT)
    assert proc.returncode == 130, err[-2000:]
    saved = _newest_checkpoint(run_dir)
    assert f"SIGINT (Ctrl-C): checkpointed step {saved}" in err, err[-2000:]
    assert max(_steps(run_dir)) == saved  # the step in flight was finished and saved

    launched.append(proc := start(*args, cwd=tmp_path))
    out, err = _stop(run_dir, proc, signal.SIGHUP, after=saved + 2)
    assert proc.returncode == 129, err[-2000:]
    assert f"resumed from step {saved}" in out
    hup = _newest_checkpoint(run_dir)
    assert hup > saved and f"SIGHUP (terminal closed): checkpointed step {hup}" in err

    # Both Ctrl-Cs land inside the next step's 3 s forward: the first 1 s after a step
    # was logged (not at the step boundary, where the first alone would save and exit
    # before the second: seen once in CI under load), the second 0.5 s later.
    slow = {"FSDPKIT_TEST_FORWARD_DELAY": "3.0"}
    launched.append(proc := start(*args, cwd=tmp_path, env=slow))
    out, err = _stop(run_dir, proc, signal.SIGINT, signal.SIGINT, after=hup + 1, lead=1.0)
    assert proc.returncode == 130, err[-2000:]
    assert "a second SIGINT: stopped at once without saving" in err, err[-2000:]
    assert f"newest complete checkpoint is step {hup}" in err
    assert _newest_checkpoint(run_dir) == hup


def _listen_silently() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock


@pytest.mark.parametrize("nodes", ["1", "2"])
def test_6_busy_rendezvous_port_fails_without_waiting_naming_the_holder(
    tmp_path: Path, nodes: str
) -> None:
    with _listen_silently() as sock:
        port = sock.getsockname()[1]
        # timeout=120 is a hang guard under the rendezvous' 600-s join timeout: a run
        # that waited for the busy port raises TimeoutExpired here
        started = time.monotonic()
        result = fsdpkit(
            "train", "--nnodes", nodes, "--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
            *FAST, f"logging.run_dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120,
        )  # fmt: skip
        took = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-2000:]
    assert took < 60, f"a refused launch took {took:.0f} s (docs/runtime.md: start-up only)"
    err = result.stderr
    assert f"127.0.0.1:{port}" in err and f"pid {os.getpid()}" in err and "free port" in err
    assert "Traceback" not in err


@contextlib.contextmanager
def _read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A read-only file system (a small tmpfs mounted ro) where we may mount; else a
    directory without write permission (which root would not be refused)."""
    target = tmp_path / "ro"
    target.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(target)]
    if subprocess.run(mount, capture_output=True).returncode == 0:
        try:
            yield target
        finally:
            subprocess.run(["umount", str(target)], check=False)
        return
    assert os.geteuid() != 0, "root that cannot mount: no way to make a read-only directory"
    target.chmod(0o555)
    try:
        yield target
    finally:
        target.chmod(0o755)


def test_7_run_dir_faults_are_one_paragraph_before_any_worker_starts(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    result = fsdpkit("train", *FAST, f"logging.run_dir={afile}", cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and "is a regular file" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and afile.read_text() == "not a directory"

    with _read_only_dir(tmp_path) as ro:
        run_dir = ro / "run"
        result = fsdpkit("train", *FAST, f"logging.run_dir={run_dir}", cwd=tmp_path, timeout=120)
    err = result.stderr
    assert result.returncode == 2 and str(run_dir) in err, err
    assert "the file system is read-only" in err or "permission denied" in err, err
    assert "Traceback" not in err


def test_7_disk_full_while_appending_metrics_stops_naming_the_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC, from the kernel
    result = fsdpkit(
        "train", *FAST, "checkpoint.every=1", "checkpoint.resume=auto",
        f"logging.run_dir={run_dir}", cwd=tmp_path,
    )  # fmt: skip
    err = result.stderr
    assert result.returncode == 2, err[-3000:]
    assert "metrics.jsonl" in err and "the disk is full" in err, err[-3000:]
    # the {"step", "data"} record is written before the first step: nothing is trained
    assert "Training stopped after step 0" in err and "There is no complete checkpoint" in err
    assert err.count("Traceback") == 0 and "Connection reset" not in err


def test_7_a_write_cut_short_leaves_no_torn_line(tmp_path: Path) -> None:
    """A real short write (the kernel's file-size limit, RLIMIT_FSIZE, hit in the
    middle of a record): the file is cut back and stays readable."""
    path = tmp_path / "metrics.jsonl"
    code = (
        "import resource, signal, sys\n"
        "from fsdpkit.runtime.rundir import append_line\n"
        "from pathlib import Path\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "p = Path(sys.argv[1])\n"
        "append_line(p, {'step': 1, 'loss': 1.5}, what='m')\n"
        "limit = p.stat().st_size + 10\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    append_line(p, {'step': 2, 'loss': 2.5, 'pad': 'x' * 50}, what='m')\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120
    )
    assert "RunDirError" in result.stdout and "ulimit -f" in result.stdout, result
    assert path.read_text() == json.dumps({"step": 1, "loss": 1.5}) + "\n"


def test_9_10_binary_data_is_refused_and_too_many_workers_are_flagged(tmp_path: Path) -> None:
    result = fsdpkit(
        "train", "--nproc", "1", *FAST, "data.path=/bin/ls", f"logging.run_dir={tmp_path / 'run'}",
        cwd=tmp_path, timeout=180,
    )  # fmt: skip
    err = result.stderr
    assert result.returncode == 2, err[-3000:]
    assert "/bin/ls does not look like text (it contains NUL bytes)" in err
    assert "data.allow_binary = true" in err and "Traceback" not in err

    cores = len(os.sched_getaffinity(0))
    huge = fsdpkit("train", "--nproc", "100000", *FAST, cwd=tmp_path, timeout=120)
    err = huge.stderr
    assert huge.returncode == 2, err[-2000:]
    assert err.count("warning: --nproc 100000 starts 100000 workers") == 1, err
    assert f"on {cores} CPU cores" in err and f"(suggested: --nproc {cores})" in err
    assert "GiB of host memory" in err and "Use --nproc" in err
    assert not (tmp_path / "runs").exists()  # refused before anything started


def test_11_a_worker_killed_by_a_signal_is_named_not_its_peers_errors(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    run_dir = tmp_path / "run"
    launched.append(proc := start("train", *LONG, f"logging.run_dir={run_dir}", cwd=tmp_path))
    wait_for_step(run_dir, 3, proc)
    victim = next(p for p in children(proc.pid) if _rank_of(p) == 1)
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert f"rank 1 (pid {victim}) was killed by SIGKILL" in err, err[-3000:]
    assert "Connection reset" not in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 3, err
