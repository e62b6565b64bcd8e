"""``fsdpkit doctor`` in a SLURM allocation (fsdpkit.doctor.slurmjob) from SLURM's
variables; the real allocation: tests/slurm/test_slurm_jobs.py."""

from __future__ import annotations

from fsdpkit.doctor import slurmjob

TASK = {
    "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS": "1",
    "SLURM_TASKS_PER_NODE": "1", "SLURM_NODEID": "0", "SLURMD_NODENAME": "localhost",
    "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "1",
}  # fmt: skip


def test_the_allocation_is_described_and_checked() -> None:
    assert slurmjob.slurm_checks({}) == []
    checks = {c.name: c for c in slurmjob.slurm_checks(TASK)}
    assert checks["slurm allocation"].message == (
        "job 7: 1 node(s) localhost; 1 task(s) (1 per node); here: node 0 (localhost), task 0"
    )
    assert checks["slurm rendezvous"].status == "ok"
    assert "127.0.0.1:10007" in checks["slurm rendezvous"].message
    assert checks["slurm nodes"].status == "ok"
    bad = {**TASK, "SLURM_JOB_NODELIST": "no-such-host-fsdpk[1-2]"}
    assert {c.status for c in slurmjob.slurm_checks(bad)} >= {"fail"}


def test_one_task_per_node_gets_slurms_endpoint() -> None:
    two = {**TASK, "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_STEP_NODELIST": "n[0-1]",
           "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2"}  # fmt: skip
    assert slurmjob.network_options(two) == ("n0:10007", 2, 1)
    assert slurmjob.network_options({**two, "SLURM_STEP_TASKS_PER_NODE": "2"}) is None
    assert slurmjob.network_options(TASK) is None  # one node
