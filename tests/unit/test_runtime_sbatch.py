"""``fsdpkit slurm``'s script (fsdpkit.runtime.sbatch): what it asks SLURM for, what it
refuses, and the requeue after a saved stop ([Note: SLURM stop and requeue]). The script
itself runs under real SLURM in tests/slurm."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdpkit.errors import UserError
from fsdpkit.runtime import sbatch


def test_slurm_times_read_as_seconds() -> None:
    assert [sbatch.time_seconds(t) for t in ["30", "1:30", "2:00:00", "1-2", "1-0:1:2"]] == [
        1800, 90, 7200, 93600, 86462,
    ]  # fmt: skip
    with pytest.raises(ValueError):
        sbatch.time_seconds("soon")


def test_the_script_requeues_only_after_a_saved_stop() -> None:
    spec = sbatch.JobSpec(items=("run.toml",), nodes=2, tasks_per_node=4, run_dir=Path("/r"),
                          time="1:00:00", partition="gpu", gpus=True)  # fmt: skip
    text = sbatch.render(spec)
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --time=1:00:00", "#SBATCH --partition=gpu", "#SBATCH --requeue",
                 "#SBATCH --signal=USR1@120", "#SBATCH --open-mode=append",
                 "#SBATCH --output=/r/slurm-%j.out", "trap 'terminated=1' TERM",
                 'case "$terminated:$code" in 0:138|0:143)']:  # fmt: skip
        assert line in text.splitlines() or line in text, line
    plain = sbatch.render(sbatch.JobSpec(items=(), nodes=1, tasks_per_node=1, requeue=False))
    assert "scontrol requeue" not in plain and "--output" not in plain
    assert spec.log_of(42) == Path("/r/slurm-42.out")


@pytest.mark.parametrize(
    ("change", "names"),
    [({"nodes": 0}, "--nodes"), ({"signal": "KILL"}, "--signal"), ({"grace_s": 0}, "--grace"),
     ({"time": "soon"}, "--time"), ({"time": "1", "grace_s": 60}, "--time 1 (60 s)")],
)  # fmt: skip
def test_bad_job_options_are_refused_naming_them(change: dict, names: str) -> None:
    spec = sbatch.JobSpec(**{"items": (), "nodes": 1, "tasks_per_node": 1, **change})
    with pytest.raises(UserError, match=names.replace("(", r"\(").replace(")", r"\)")):
        sbatch.check_spec(spec)
