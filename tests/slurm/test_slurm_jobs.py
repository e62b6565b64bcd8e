"""``fsdpkit slurm`` jobs through real ``sbatch`` on a real cluster (munge, slurmctld,
two slurmds in network namespaces: tests/slurm/conftest.py):

- a 2-node job (1 task per node) trains the losses of a 1-node job (2 tasks), bit for bit;
- ``scontrol requeue``, ``scancel --signal=TERM`` and ``--signal=USR1``: every rank
  saves the step it is on within KillWait, the job comes back under the same id and
  resumes from that step with the uninterrupted run's losses, bit for bit;
- a node set DOWN mid-run, or crashed (every process on it SIGKILLed, slurmd
  included): the job ends, its log names the node, the newest checkpoint verifies;
- a job script whose task count the config cannot use: one paragraph, exit 2.

Each records its timing (``record``) for docs/runtime.md's "SLURM, tested" table.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurmjobs import (
    ARGS,
    EVERY,
    SLOW,
    STEPS,
    checkpoint_steps,
    fsdpkit_slurm,
    job_log,
    losses,
    submit,
    wait_for_step,
)

from slurmcluster import DONE, SlurmCluster
from slurmconf import KILL_WAIT_S

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

REPEAT = range(int(os.environ.get("FSDPKIT_SLURM_REPEAT", "1")))
"""``FSDPKIT_SLURM_REPEAT=10``: run each requeue scenario that many times (reliability)."""


@pytest.fixture(scope="module")
def reference(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted 2-node job (1 task per node): its losses, time and record."""
    slurm_cluster.cancel_all()
    slurm_cluster.wait_idle()
    run_dir = tmp_path_factory.mktemp("slurm-ref") / "two-nodes"
    run_dir.mkdir()
    start = time.monotonic()
    job = submit(slurm_cluster, run_dir, nodes=2, tasks=1)
    info = slurm_cluster.wait(job)
    seconds = time.monotonic() - start
    assert info["JobState"] == "COMPLETED", f"{info}\n{job_log(run_dir, job)}"
    return {
        "losses": losses(run_dir),
        "seconds": seconds,
        "info": info,
        "log": job_log(run_dir, job),
    }


def test_two_nodes_train_the_one_node_losses(
    slurm: SlurmCluster, reference: dict, tmp_path: Path, record
) -> None:
    assert reference["info"]["NodeList"] == "fsdpk-node[0-1]"
    assert "on fsdpk-node[0-1]" in reference["log"]
    assert len(reference["losses"]) == STEPS
    start = time.monotonic()
    job = submit(slurm, tmp_path / "one-node", nodes=1, tasks=2)
    info = slurm.wait(job)
    one = time.monotonic() - start
    assert info["JobState"] == "COMPLETED", job_log(tmp_path / "one-node", job)
    assert losses(tmp_path / "one-node") == reference["losses"]  # bit for bit
    record(
        scenario="2 nodes x 1 task vs 1 node x 2 tasks",
        happens=f"the same {STEPS} losses, bit for bit; MASTER_ADDR = the first node of "
        "SLURM_JOB_NODELIST, resolved inside the nodes",
        seconds=f"{reference['seconds']:.1f} / {one:.1f} per job",
        command="fsdpkit slurm --nodes 2 --tasks-per-node 1 ... (and --nodes 1 --tasks-per-node 2)",
    )


def _saved_and_resumed(
    slurm: SlurmCluster, reference: dict, run_dir: Path, job: int, signalled: float
) -> tuple[float, float]:
    """After a stop signal at ``signalled`` (time.time()): the step it was on saved
    within KillWait, the job requeued, resumed there and finished with the reference's
    losses. (seconds to the save, seconds from the signal to the end)."""
    while not [s for s in checkpoint_steps(run_dir) if s % EVERY]:  # the signal's save
        assert time.time() - signalled < KILL_WAIT_S, f"no save within {KILL_WAIT_S} s"
        time.sleep(0.05)
    save_s = time.time() - signalled
    resumed = slurm.release(job)
    assert int(resumed["Restarts"]) == 1, resumed
    info = slurm.wait(job)
    end = time.time() - signalled
    log = job_log(run_dir, job)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}\n{slurm.tail()}"
    saved = {int(part.split()[0]) for part in log.split(": checkpointed step ")[1:]}
    assert len(saved) == 1, log  # rank 0's progress line and its stop note say the same
    step = saved.pop()
    assert step % EVERY, f"step {step} was saved by checkpoint.every, not by the signal: {log}"
    assert f"resumed from step {step}" in log, log
    assert losses(run_dir) == reference["losses"], log  # the same next losses, bit for bit
    return save_s, end


@pytest.mark.parametrize("attempt", REPEAT)
def test_scontrol_requeue_saves_the_step_and_resumes(
    slurm: SlurmCluster, reference: dict, tmp_path: Path, record, attempt: int
) -> None:
    run_dir = tmp_path / "requeue"
    job = submit(slurm, run_dir, nodes=2, tasks=1, env=SLOW)
    wait_for_step(run_dir, 3)
    signalled = time.time()
    slurm.run(["scontrol", "requeue", str(job)])
    save_s, end = _saved_and_resumed(slurm, reference, run_dir, job, signalled)
    record(
        scenario="`scontrol requeue` mid-run",
        happens="slurmd's SIGTERM (twice: srun forwards it too) reaches every rank; the "
        "step is saved, the job requeued under its id, resumed there: the same losses",
        seconds=f"saved {save_s:.1f} s after the requeue; finished {end:.1f} s after it",
        command="scontrol requeue JOBID",
    )


@pytest.mark.parametrize("attempt", REPEAT)
@pytest.mark.parametrize(
    "signal",
    # TERM is slow-marked: test_scontrol_requeue's SIGTERM and USR1 here take its path
    [pytest.param("TERM", marks=pytest.mark.slow), "USR1"],
)
def test_preemption_signal_saves_the_step_and_requeues(
    slurm: SlurmCluster, reference: dict, tmp_path: Path, record, signal: str, attempt: int
) -> None:
    run_dir = tmp_path / f"sig{signal}"
    job = submit(slurm, run_dir, nodes=2, tasks=1, env=SLOW)
    wait_for_step(run_dir, 3)
    signalled = time.time()
    slurm.run(["scancel", f"--signal={signal}", str(job)])
    save_s, end = _saved_and_resumed(slurm, reference, run_dir, job, signalled)
    log = job_log(run_dir, job)
    code = {"TERM": 143, "USR1": 138}[signal]
    assert f"step saved (exit {code}): requeueing job {job}" in log, log
    record(
        scenario=f"`scancel --signal={signal}` mid-run (a preemption warning)",
        happens=f"every rank saves the step and exits {code}; the script requeues its own "
        "job, which resumes there: the same losses",
        seconds=f"saved {save_s:.1f} s after the signal; finished {end:.1f} s after it",
        command=f"scancel --signal={signal} JOBID",
    )


@pytest.mark.parametrize("how", ["down", pytest.param("crash", marks=pytest.mark.slow)])
def test_a_lost_node_ends_the_run_naming_it(
    slurm: SlurmCluster, reference: dict, tmp_path: Path, record, how: str
) -> None:
    """The job (--requeue) ends its run, names the node, SLURM requeues it; the newest
    checkpoint verifies. After a crash (slow: slurmctld notices a silent node ~20 s
    later) the job is also run again: it resumes from that checkpoint to the
    reference's losses."""
    run_dir = tmp_path / f"node-{how}"
    job = submit(slurm, run_dir, nodes=2, tasks=1, env=SLOW, more=("checkpoint.every=2",))
    wait_for_step(run_dir, 3)
    lost = time.monotonic()
    if how == "down":
        slurm.run(["scontrol", "update", "nodename=fsdpk-node1", "state=down", "reason=test"])
    else:
        assert slurm.crash_node(1)
    info = slurm.wait(job, until=("PENDING", *DONE), timeout=120)
    ended = time.monotonic() - lost
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1", info
    deadline = time.monotonic() + 60  # until the run's batch script on node 0 is done
    while slurm.node_states()["fsdpk-node0"] != "idle" and time.monotonic() < deadline:
        time.sleep(0.2)
    slurm.wait_idle()  # node 1 back: its slurmd started again, or resumed from DOWN
    log = job_log(run_dir, job)
    if how == "down":  # the script lists the allocation's down nodes after srun failed
        assert "fsdpkit slurm: node(s) of this job down: fsdpk-node1 (down: test)" in log, log
    else:  # rank 0 names the node its collective lost, in one paragraph (the batch script
        # is SIGKILLed after KillWait while srun still waits for the dead node's tasks)
        assert "error: lost node fsdpk-node1 at " in log and "Traceback" not in log, log
    steps = checkpoint_steps(run_dir)
    assert steps, log
    verify = subprocess.run(
        [sys.executable, "-m", "fsdpkit", "ckpt", "verify",
         str(run_dir / "checkpoints" / f"step-{steps[-1]:08d}")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    if how == "crash":
        slurm.release(job)
        done = slurm.wait(job)
        assert done["JobState"] == "COMPLETED", f"{done}\n{job_log(run_dir, job)}"
        assert losses(run_dir)[-3:] == reference["losses"][-3:]
    what = "set DOWN (`scontrol update state=down`)" if how == "down" else (
        "crashed: every process on it SIGKILLed, slurmd included"
    )  # fmt: skip
    record(
        scenario=f"node 1 {what} mid-run",
        happens=f"the run ends and SLURM requeues the job; its log names fsdpk-node1; the "
        f"newest checkpoint (step {steps[-1]}) verifies"
        + (
            "; run again, the job resumes from it to the same final losses (slow test)"
            if how == "crash"
            else ""
        ),
        seconds=f"run over {ended:.1f} s after",
        command="scontrol update nodename=NODE state=down reason=..."
        if how == "down"
        else "kill -9 every process of the node",
    )


def test_a_wrong_task_count_is_refused_in_one_paragraph(
    slurm: SlurmCluster, tmp_path: Path, record
) -> None:
    run_dir = tmp_path / "wrong"
    refused = fsdpkit_slurm(
        slurm, "--nodes", "1", "--tasks-per-node", "1", *ARGS, "parallel.tp=2",
        f"logging.run_dir={run_dir}", cwd=tmp_path,
    )  # fmt: skip
    assert refused.returncode == 2 and not (run_dir / "job.sbatch").exists()
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "parallel.tp" in refused.stderr
    # The script rendered for 2 tasks, submitted by hand with 1: the job refuses it.
    made = fsdpkit_slurm(
        slurm, "--nodes", "1", "--tasks-per-node", "2", *ARGS, "parallel.tp=2",
        f"logging.run_dir={run_dir}", "--print", cwd=tmp_path,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    run_dir.mkdir()
    (run_dir / "job.sbatch").write_text(made.stdout)
    start = time.monotonic()
    job = slurm.submit(run_dir / "job.sbatch", "--ntasks-per-node=1", cwd=tmp_path)
    info = slurm.wait(job)
    seconds = time.monotonic() - start
    log = job_log(run_dir, job)
    ours = [line for line in log.splitlines() if line.startswith("fsdpkit train")]
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", f"{info}\n{log}"
    assert (
        len(ours) == 1
        and "parallel.tp x parallel.cp = 2 x 1 = 2 does not divide the world size 1" in ours[0]
    ), log
    assert not (run_dir / "checkpoints").exists()
    record(
        scenario="a config that 1 task cannot run (parallel.tp = 2)",
        happens="`fsdpkit slurm` refuses before submitting (one line, exit 2); the same "
        "script submitted with --ntasks-per-node=1: rank 0 says why in one paragraph, the "
        "job fails with exit 2 before any rendezvous",
        seconds=f"job over {seconds:.1f} s after sbatch",
        command="sbatch --ntasks-per-node=1 job.sbatch",
    )


DOCTOR_JOB = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output={out}/batch.txt
{python} -m fsdpkit doctor --json > {out}/batch.json
srun --output={out}/task-%t.json --error={out}/task-%t.err \\
    {python} -m fsdpkit doctor --json --timeout 30
"""


def _checks(path: Path) -> dict[str, dict]:
    import json

    return {c["name"]: c for c in json.loads(path.read_text())["checks"]}


def test_doctor_inside_an_allocation(slurm: SlurmCluster, tmp_path: Path, record) -> None:
    script = tmp_path / "doctor.sbatch"
    script.write_text(DOCTOR_JOB.format(out=tmp_path, python=sys.executable))
    start = time.monotonic()
    job = slurm.submit(script, cwd=tmp_path)
    info = slurm.wait(job)
    seconds = time.monotonic() - start
    assert info["JobState"] == "COMPLETED", f"{info}\n{(tmp_path / 'batch.txt').read_text()}"
    batch = _checks(tmp_path / "batch.json")
    assert (
        "2 node(s) fsdpk-node0, fsdpk-node1; 2 task(s) (1(x2) per node)"
        in (batch["slurm allocation"]["message"])
    )
    node0, node1 = (slurm.nodes[i].address for i in (0, 1))
    assert f"MASTER_ADDR fsdpk-node0 = {node0}" in batch["slurm rendezvous"]["message"]
    assert "on eth0" in batch["slurm rendezvous"]["message"]
    assert batch["slurm nodes"]["message"] == f"fsdpk-node0 = {node0}, fsdpk-node1 = {node1}"
    for task in (0, 1):
        checks = _checks(tmp_path / f"task-{task}.json")
        assert (
            f"here: node {task} (fsdpk-node{task}), task {task}"
            in (checks["slurm allocation"]["message"])
        )
        assert checks["nodes joined"]["status"] == "ok", checks["nodes joined"]
        assert checks["all-reduce"]["status"] == "ok", checks["all-reduce"]
    record(
        scenario="`fsdpkit doctor` in an allocation, then as one srun task per node",
        happens="names the job's 2 nodes, its tasks and where it runs; MASTER_ADDR = "
        "fsdpk-node0 and its address, reached through eth0; under srun both nodes meet at "
        "SLURM's endpoint with no option and all-reduce over the veth",
        seconds=f"{seconds:.1f} (job)",
        command="fsdpkit doctor; srun --ntasks-per-node=1 fsdpkit doctor",
    )


@pytest.mark.slow
def test_the_time_limit_warning_saves_and_the_job_comes_back(
    slurm: SlurmCluster, tmp_path: Path, record
) -> None:
    """A real ``--time=3 --signal=USR1@120``: slurmctld sends SIGUSR1 once less than 120 s
    are left (it checks time limits every ~30 s, so 60-90 s in), every rank saves, the
    script requeues the job; each run gets the limit again, until all steps are done
    with the losses of an uninterrupted run."""
    steps = ("train.steps=100",)
    ref = tmp_path / "ref"
    job = submit(slurm, ref, nodes=2, tasks=1, more=steps)
    assert slurm.wait(job)["JobState"] == "COMPLETED", job_log(ref, job)
    run_dir = tmp_path / "limited"
    start = time.monotonic()
    slow = {"FSDPKIT_TEST_FORWARD_DELAY": "1.0"}  # ~1.2 s a step: 100 outlast 90 s
    job = submit(slurm, run_dir, nodes=2, tasks=1, env=slow, more=steps,
                 extra=("--time=3", "--grace=120"))  # fmt: skip
    while (info := slurm.wait(job, until=("PENDING", *DONE), timeout=150))["JobState"] == "PENDING":
        slurm.release(job)
    seconds = time.monotonic() - start
    log = job_log(run_dir, job)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}"
    assert "SIGUSR1 (the time limit is near): checkpointed step" in log, log
    assert "step saved (exit 138): requeueing job" in log, log
    assert losses(run_dir) == losses(ref), log
    record(
        scenario="a real time limit: `--time=3 --signal=USR1@120` (slow test)",
        happens="slurmctld's SIGUSR1 60-90 s into the run; every rank saves, the script "
        f"requeues the job, which resumes ({info['Restarts']} requeue(s)): the same 100 losses",
        seconds=f"{seconds:.1f} to the end",
        command="fsdpkit slurm --time 3 --grace 120 ...",
    )
