"""Submitting ``fsdpkit train`` through ``fsdpkit slurm`` to the test cluster, as a user
on its login node would, and reading what the job left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from clirun import FAST, cli_env

from slurmcluster import SlurmCluster

STEPS = 8
EVERY = 5
"""checkpoint.every: a signal at step 3 or 4 saves a step of its own."""
ARGS = [
    *[a for a in FAST if not a.startswith(("train.steps", "checkpoint.resume", "train.eval"))],
    f"train.steps={STEPS}",
    "train.eval_every=0",
    f"checkpoint.every={EVERY}",
    "checkpoint.resume=auto",
    "logging.progress=lines",
    "model.factory=factories:sluggish",
]
SLOW = {"FSDPKIT_TEST_FORWARD_DELAY": "0.3"}
"""Steps long enough (~1.2 s) to signal a job in the middle of one; numerics unchanged."""


def fsdpkit_slurm(
    c: SlurmCluster, *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``fsdpkit slurm *args`` on the cluster's login node (sbatch reaches slurmctld
    only from there); the job inherits ``env`` (sbatch exports the environment)."""
    argv = [sys.executable, "-m", "fsdpkit", "slurm", *args]
    full = {**cli_env(env), "SLURM_CONF": str(c.layout.conf)}
    return subprocess.run(c.login(argv), env=full, cwd=cwd, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def submit(
    c: SlurmCluster, run_dir: Path, *, nodes: int, tasks: int, env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (), more: tuple[str, ...] = (),
) -> int:  # fmt: skip
    """``fsdpkit slurm --nodes N --tasks-per-node T [extra] ARGS [more]`` for ``run_dir``
    (``more``: overrides after ARGS); the job id."""
    out = fsdpkit_slurm(
        c, "--nodes", str(nodes), "--tasks-per-node", str(tasks), *extra, *ARGS, *more,
        f"logging.run_dir={run_dir}", cwd=run_dir.parent, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split("submitted job ")[1].split(":")[0])


def job_log(run_dir: Path, job_id: int) -> str:
    path = run_dir / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else f"(no log at {path})"


def losses(run_dir: Path) -> list[float]:
    """Every step's loss, in order, over all incarnations of the job."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def wait_for_step(run_dir: Path, step: int, *, timeout: float = 120) -> float:
    """Until metrics.jsonl has ``step``; the time it did."""
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists():
            lines = [x for x in path.read_text().splitlines() if x.endswith("}")]
            steps = [json.loads(x).get("step", 0) for x in lines]
            if steps and max(steps) >= step:
                return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"{run_dir} did not reach step {step} within {timeout} s")


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints of the run."""
    from fsdpkit.checkpoint.stepdir import complete_entries

    return [e.step for e in complete_entries(run_dir / "checkpoints")]
