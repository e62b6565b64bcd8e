"""Fault injection around ``fsdpkit train``: kills, signals, a closed terminal, disk
faults, a second launch, a busy port. Prints one row per scenario.

    .venv/bin/python bench/faults.py                 # every scenario (~10 min on 2 cores)
    .venv/bin/python bench/faults.py sigint kill9-launcher-group

Each scenario starts the same small run (40 steps, a checkpoint every 5) in its own
run dir, injects its fault mid-run, then checks "nothing lost":
- no process of the run is alive 5 s after the faulted run's launcher is gone;
- the newest complete checkpoint is at least the last one saved before the fault;
- rerunning the same command (after undoing the fault: free space, ...) finishes,
  and its losses for every step from the resumed one on equal an uninterrupted
  run's bit for bit.
Columns: the faulted run's exit code and first stderr line, the step it had logged,
the step the rerun resumed from, leftover processes, and the verdict.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
from clirun import FAST

PY = sys.executable
ARGS = [
    *[a for a in FAST if not a.startswith(("train.steps", "train.eval", "checkpoint.resume"))],
    "train.steps=40",
    "train.eval_every=0",
    "checkpoint.every=5",
    "checkpoint.resume=auto",
    "logging.progress=lines",
]
FAULT_AT = 12
"""The step after which each fault is injected."""
TIMING = {"to_fault": 15.0}
"""Seconds the reference run took to log step FAULT_AT (measured in main)."""


def command(run_dir: Path, *extra: str) -> list[str]:
    return [PY, "-m", "fsdpkit", "train", *extra, *ARGS, f"logging.run_dir={run_dir}"]


def records(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                r = json.loads(line)
                if "loss" in r:
                    out[int(r["step"])] = float(r["loss"])
    return out


def wait_step(run_dir: Path, step: int, alive: Callable[[], bool], timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        seen = max(records(run_dir), default=0)
        if seen >= step:
            return seen
        time.sleep(0.02)
    return max(records(run_dir), default=0)


def checkpoints(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step-*") if "." not in p.name and (p / "fsdpkit.json").is_file()]
    return sorted(int(p.name.split("-")[1]) for p in done)


def processes_of(run_dir: Path) -> list[int]:
    needle = str(run_dir).encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
    return found


def children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


@dataclass
class Outcome:
    code: int | None
    message: str
    logged: int
    saved_before: int


@dataclass
class Row:
    scenario: str
    code: str
    logged: int
    resumed: str
    leftovers: int
    verdict: str
    message: str


def start(run_dir: Path, *extra: str, prefix: list[str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*(prefix or []), *command(run_dir, *extra)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def signal_launcher(*signals: int, gap: float = 0.0) -> Callable[[Path], Outcome]:
    def scenario(run_dir: Path) -> Outcome:
        proc = start(run_dir)
        logged = wait_step(run_dir, FAULT_AT, lambda: proc.poll() is None)
        saved = max(checkpoints(run_dir), default=0)
        for i, sig in enumerate(signals):
            time.sleep(gap if i else 0)
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
        return Outcome(proc.returncode, first_line(err), logged, saved)

    return scenario


def kill_group(run_dir: Path) -> Outcome:
    proc = start(run_dir)
    logged = wait_step(run_dir, FAULT_AT, lambda: proc.poll() is None)
    saved = max(checkpoints(run_dir), default=0)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return Outcome(proc.returncode, "(killed)", logged, saved)


def timeout_kill(run_dir: Path) -> Outcome:
    """``timeout -s KILL T fsdpkit train ...``: T is when the reference run had logged
    step FAULT_AT, so the kill lands mid-run."""
    proc = start(run_dir, prefix=["timeout", "-s", "KILL", f"{TIMING['to_fault']:.1f}"])
    proc.communicate(timeout=300)
    logged = max(records(run_dir), default=0)
    saved = max(checkpoints(run_dir), default=0)
    return Outcome(proc.returncode, f"timeout -s KILL {TIMING['to_fault']:.0f}", logged, saved)


def closed_terminal(run_dir: Path) -> Outcome:
    """The launcher's controlling terminal goes away (a closed terminal window)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(PY, command(run_dir))
    drained: list[bytes] = []

    def drain() -> None:
        with contextlib.suppress(OSError):
            while chunk := os.read(fd, 4096):
                drained.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    logged = wait_step(run_dir, FAULT_AT, lambda: os.waitpid(pid, os.WNOHANG) == (0, 0))
    saved = max(checkpoints(run_dir), default=0)
    os.close(fd)  # hang up: the kernel sends SIGHUP to the terminal's session
    _, status = os.waitpid(pid, 0)
    return Outcome(os.waitstatus_to_exitcode(status), "(terminal closed)", logged, saved)


def kill_worker(run_dir: Path) -> Outcome:
    proc = start(run_dir)
    logged = wait_step(run_dir, FAULT_AT, lambda: proc.poll() is None)
    saved = max(checkpoints(run_dir), default=0)
    os.kill(children(proc.pid)[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    return Outcome(proc.returncode, first_line(err), logged, saved)


def second_launch(run_dir: Path) -> Outcome:
    """A second ``fsdpkit train`` into the directory of a running one (frozen with
    SIGSTOP meanwhile, so it cannot finish first); then the first one goes on."""
    proc = start(run_dir)
    wait_step(run_dir, FAULT_AT, lambda: proc.poll() is None)
    group = [proc.pid, *children(proc.pid)]
    for pid in group:
        os.kill(pid, signal.SIGSTOP)
    second = subprocess.run(command(run_dir), capture_output=True, text=True, timeout=300)
    for pid in group:
        os.kill(pid, signal.SIGCONT)
    proc.communicate(timeout=300)  # the first run finishes undisturbed
    return Outcome(second.returncode, first_line(second.stderr), 40, 40)


def metrics_disk_full(run_dir: Path) -> Outcome:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").symlink_to("/dev/full")
    proc = start(run_dir)
    _, err = proc.communicate(timeout=300)
    (run_dir / "metrics.jsonl").unlink()  # "free space" for the rerun
    return Outcome(proc.returncode, first_line(err), 0, 0)


def run_dir_disk_full(run_dir: Path) -> Outcome:
    """The whole run dir on a 2 MiB tmpfs: the second checkpoint (1.4 MB each) does not fit."""
    run_dir.mkdir(parents=True)
    mount = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(run_dir)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        return Outcome(None, "skipped: cannot mount a tmpfs (needs root)", 0, 0)
    proc = start(run_dir)
    _, err = proc.communicate(timeout=300)
    subprocess.run(["mount", "-o", "remount,size=512m", str(run_dir)], check=True)
    return Outcome(proc.returncode, first_line(err), max(records(run_dir), default=0), 0)


def busy_port(run_dir: Path) -> Outcome:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
        t0 = time.monotonic()
        proc = start(run_dir, "--rdzv-endpoint", endpoint)
        _, err = proc.communicate(timeout=900)
        took = time.monotonic() - t0
    return Outcome(proc.returncode, f"{took:.0f}s: {first_line(err)}", 0, 0)


def first_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("fsdpkit train")]
    return (lines[-1] if lines else text.strip()[-200:])[:150]


SCENARIOS: dict[str, Callable[[Path], Outcome]] = {
    "kill9-launcher-group": kill_group,
    "timeout-s-KILL": timeout_kill,
    "closed-terminal": closed_terminal,
    "sigint": signal_launcher(signal.SIGINT),
    "sighup": signal_launcher(signal.SIGHUP),
    "sigterm": signal_launcher(signal.SIGTERM),
    "double-ctrl-c": signal_launcher(signal.SIGINT, signal.SIGINT, gap=0.05),
    "kill9-one-worker": kill_worker,
    "second-launch-same-dir": second_launch,
    "metrics-disk-full": metrics_disk_full,
    "run-dir-disk-full": run_dir_disk_full,
    "busy-rdzv-port": busy_port,
}


def judge(name: str, run_dir: Path, outcome: Outcome, reference: dict[int, float]) -> Row:
    deadline = time.monotonic() + 5
    while processes_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftovers = processes_of(run_dir)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    newest = max(checkpoints(run_dir), default=0)
    intact = newest >= outcome.saved_before
    rerun = subprocess.run(command(run_dir), capture_output=True, text=True, timeout=600)
    resumed = next(
        (ln.split()[-1] for ln in rerun.stdout.splitlines() if ln.startswith("resumed from")), "0"
    )
    got = records(run_dir)
    same = rerun.returncode == 0 and all(
        got.get(s) == reference[s] for s in range(int(resumed) + 1, 41)
    )
    ok = same and intact and not leftovers
    return Row(
        name,
        str(outcome.code),
        outcome.logged,
        resumed,
        len(leftovers),
        "nothing lost" if ok else f"LOST (rerun {rerun.returncode}, same={same}, intact={intact})",
        outcome.message,
    )


def main(names: list[str]) -> int:
    chosen = names or list(SCENARIOS)
    with tempfile.TemporaryDirectory(prefix="fsdpkit-faults-") as tmp:
        ref_dir = Path(tmp) / "reference"
        t0 = time.monotonic()
        ref = start(ref_dir)
        wait_step(ref_dir, FAULT_AT, lambda: ref.poll() is None)
        TIMING["to_fault"] = time.monotonic() - t0
        _, err = ref.communicate(timeout=600)
        assert ref.returncode == 0, err[-2000:]
        reference = records(ref_dir)
        rows = []
        for name in chosen:
            run_dir = Path(tmp) / name
            outcome = SCENARIOS[name](run_dir)
            rows.append(judge(name, run_dir, outcome, reference))
            print(f"{name}: {rows[-1].verdict}", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                subprocess.run(["umount", str(run_dir)], capture_output=True)
    header = ("scenario", "exit", "logged", "resumed", "left", "verdict", "message")
    table = [header, *[(r.scenario, r.code, str(r.logged), r.resumed, str(r.leftovers),
                         r.verdict, r.message) for r in rows]]  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1])
    return 0 if all(r.verdict == "nothing lost" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
