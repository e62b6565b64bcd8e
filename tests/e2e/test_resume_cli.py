"""Runs that are stopped and resumed through the CLI end where uninterrupted ones do.

- SIGTERM (preemption) to the launcher: the current step is checkpointed; running
  the same command again resumes and gives bitwise the same losses.
- SIGKILL of one worker under a restart budget: the job restarts every worker,
  resumes from the newest complete checkpoint and ends with the same losses.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from clirun import FAST, children, fsdpkit, losses, start, wait_for_step

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 60
ARGS = [
    *FAST,
    f"train.steps={STEPS}",
    "train.eval_every=0",
    "checkpoint.every=5",
    "checkpoint.resume=auto",
    "logging.progress=lines",
]


def _start(run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    return start("train", *extra, *ARGS, f"logging.run_dir={run_dir}", cwd=run_dir.parent)


def _reference(tmp_path: Path) -> list[float]:
    result = fsdpkit("train", *ARGS, f"logging.run_dir={tmp_path / 'ref'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(tmp_path / "ref")


def test_sigterm_checkpoints_and_rerun_resumes_bit_exactly(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    reference = _reference(tmp_path)
    run_dir = tmp_path / "preempted"
    proc = _start(run_dir)
    launched.append(proc)
    wait_for_step(run_dir, 12, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, "a preempted run must not report success"
    assert "SIGTERM: checkpointed step" in out, out[-2000:] + err[-2000:]
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved and saved[-1] != f"step-{STEPS:08d}", saved
    again = fsdpkit("train", *ARGS, f"logging.run_dir={run_dir}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step" in again.stdout
    assert losses(run_dir) == reference


def test_killed_rank_restarts_and_ends_like_an_uninterrupted_run(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    reference = _reference(tmp_path)
    run_dir = tmp_path / "killed"
    proc = _start(run_dir, "--max-restarts", "1")
    launched.append(proc)
    wait_for_step(run_dir, 12, proc)
    workers = children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from step" in out
    assert losses(run_dir) == reference
