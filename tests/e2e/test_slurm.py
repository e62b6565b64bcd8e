"""SLURM: the sbatch file ``fsdpkit train --slurm-script`` prints runs, and its
``srun python -m fsdpkit train ...`` line trains exactly as a spawned run does.

No SLURM here, so the test plays its part: ``bash job.sbatch`` with the job-level
variables sbatch exports, and a stand-in ``srun`` on PATH that starts one task per
rank with the per-task variables slurmstepd sets (SLURM_PROCID, SLURM_LOCALID,
SLURM_NODEID). Nothing else is exported: no MASTER_ADDR / MASTER_PORT, as the README
promises.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import FAST, HERE, fsdpkit, losses

pytestmark = pytest.mark.e2e

FAKE_SRUN = """#!{python}
# Stand-in for srun: one task per rank, with the variables slurmstepd sets.
import os, subprocess, sys
args = [a for a in sys.argv[1:] if not a.startswith("--")]
if args[0] == "python":
    args[0] = {python!r}
tasks = int(os.environ["SLURM_NTASKS"])
procs = []
for rank in range(tasks):
    env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0")
    procs.append(subprocess.Popen(args, env=env))
sys.exit(max(p.wait() for p in procs))
"""


def _job_id_with_free_port() -> str:
    """A job id whose derived MASTER_PORT (10000 + id mod 10000) is free right now."""
    for _ in range(50):
        port = random.randrange(10000, 20000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(random.randrange(1, 90) * 10000 + port - 10000)
    raise AssertionError("no free port in 10000-19999")


def test_slurm_script_runs_and_equals_a_spawned_run(tmp_path: Path) -> None:
    args = [*FAST, "train.steps=6", "train.eval_every=0"]
    rendered = fsdpkit(
        "train", "--slurm-script", "--nproc", "2", *args, f"logging.run_dir={tmp_path / 'slurm'}",
        cwd=tmp_path,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(rendered.stdout)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = rendered.stdout
    assert "#SBATCH --nodes=1" in text and "#SBATCH --ntasks-per-node=2" in text
    assert "srun --kill-on-bad-exit=1 python -m fsdpkit train" in text

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "SLURM"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]),
        SLURM_JOB_ID=_job_id_with_free_port(),
        SLURM_NTASKS="2",
        SLURM_NNODES="1",
        SLURM_NODELIST=socket.gethostname(),
        SLURM_JOB_NODELIST=socket.gethostname(),
        SLURM_TASKS_PER_NODE="2",
        SLURM_JOB_NUM_NODES="1",
    )
    job = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert job.returncode == 0, job.stderr[-3000:]

    spawned = fsdpkit("train", "--nproc", "2", *args, f"logging.run_dir={tmp_path / 'spawn'}",
                      cwd=tmp_path)  # fmt: skip
    assert spawned.returncode == 0, spawned.stderr[-3000:]
    assert losses(tmp_path / "slurm") == losses(tmp_path / "spawn")
    assert len(losses(tmp_path / "slurm")) == 6
