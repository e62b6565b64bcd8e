"""Two real "nodes" (network namespaces on a bridge, tests/netns.py), one rank
each, gloo: what on 127.0.0.1 could not show (issue 24).

- a 2-node run trains the losses of a one-node run at the same world size, and every
  listener inside each namespace is bound to that node's veth address;
- node 1's launcher SIGKILLed: node 0 stops at once naming the lost node, nothing is
  left running, the newest complete checkpoint is intact;
- rerun with ``--max-restarts 1``, node 1 killed again and started again: the job
  resumes from the checkpoint and ends with the reference's losses, bit for bit;
- SLURM: the sbatch file ``--slurm-script --nnodes 2`` renders, run with a stand-in
  ``srun`` that starts one task per namespace (MASTER_ADDR from the node list, which
  resolves inside the nodes), trains the same losses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clirun import FAST, HERE, cli_env, fsdpkit, losses, metrics, wait_for_step

from fsdpkit import netinfo
from fsdpkit.checkpoint.stepdir import complete_entries
from netns import Cluster, Node

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 12
ARGS = [
    *[a for a in FAST if not a.startswith(("train.steps", "checkpoint.resume", "train.eval"))],
    f"train.steps={STEPS}",
    "train.eval_every=0",
    "checkpoint.every=3",
    "checkpoint.resume=auto",
    "logging.progress=lines",
    "model.factory=factories:sluggish",
]
SLOW = {"FSDPKIT_TEST_FORWARD_DELAY": "0.3"}
"""Steps long enough to kill a node in the middle of the run (numerics unchanged)."""
LOST_S = 30.0
"""Node 0 stops within this after node 1's launcher is killed (measured: ~2 s)."""


SRUN = """#!{python}
# Stand-in for srun: task i runs inside namespace i, with the variables slurmstepd sets.
import os, subprocess, sys
args = [a for a in sys.argv[1:] if not a.startswith("--")]
if args[0] == "python":
    args[0] = {python!r}
procs = []
for task, ns in enumerate(os.environ["FSDPKIT_TEST_NETNS"].split(",")):
    env = dict(os.environ, SLURM_PROCID=str(task), SLURM_LOCALID="0", SLURM_NODEID=str(task))
    procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *args], env=env))
sys.exit(max(p.wait() for p in procs))
"""


def on_node(node: Node, cluster: Cluster, run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    """``fsdpkit train --nnodes 2 --nproc 1`` started inside ``node``."""
    endpoint = f"{cluster.nodes[0].address}:29500"
    argv = [sys.executable, "-m", "fsdpkit", "train", "--nnodes", "2", "--nproc", "1",
            "--rdzv-endpoint", endpoint, *extra, *ARGS, f"logging.run_dir={run_dir}"]  # fmt: skip
    return subprocess.Popen(
        node.command(argv), env=cli_env(SLOW), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def paragraphs(err: str) -> list[str]:
    """fsdpkit's own lines of stderr (c10d's C++ warnings about reverse DNS left out)."""
    return [line for line in err.strip().splitlines() if line and not line.startswith("[W")]


def check_listeners(cluster: Cluster) -> None:
    """Every listening socket inside each namespace (nothing else runs there) is on
    that node's veth address: not 0.0.0.0, not loopback."""
    for node in cluster.nodes:
        found = netinfo.parse_listening(node.tcp_table())
        assert found, f"nothing listens in {node.netns}"
        assert {lst.address for lst in found} == {node.address}, (node, found)
    hosting = netinfo.parse_listening(cluster.nodes[0].tcp_table())
    assert len(hosting) >= 3, hosting  # agent store, workers' store, gloo


def test_two_nodes_train_like_one_and_survive_losing_a_node(tmp_path: Path, nodes: Cluster) -> None:
    node0, node1 = nodes.nodes
    reference = subprocess.Popen(
        [sys.executable, "-m", "fsdpkit", "train", "--nproc", "2", *ARGS,
         f"logging.run_dir={tmp_path / 'one'}"],
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    run_dir = tmp_path / "two"
    first = [on_node(n, nodes, run_dir) for n in nodes.nodes]
    wait_for_step(run_dir, 2, first[0])
    check_listeners(nodes)

    wait_for_step(run_dir, 4, first[0])
    first[1].kill()
    killed = time.monotonic()
    _, err = first[0].communicate(timeout=LOST_S + 30)
    lost_s = time.monotonic() - killed
    first[1].communicate()
    said = paragraphs(err)
    assert first[0].returncode == 1 and len(said) == 1, err[-3000:]
    assert f"lost the node at {node1.address}" in said[0], said
    assert "Traceback" not in err and lost_s < LOST_S, (lost_s, said)
    deadline = time.monotonic() + 10
    while (node0.pids() or node1.pids()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert node0.pids() == [] and node1.pids() == []
    newest = complete_entries(run_dir)[-1].step
    assert newest >= 3 and f"newest complete checkpoint is step {newest}" in said[0]
    seen = {r["step"]: r["loss"] for r in metrics(run_dir)}

    second = [on_node(n, nodes, run_dir, "--max-restarts", "1") for n in nodes.nodes]
    wait_for_step(run_dir, newest + 3, second[0])
    second[1].kill()
    second[1].communicate()
    again = on_node(node1, nodes, run_dir, "--max-restarts", "1")
    out, err = second[0].communicate(timeout=240)
    again.communicate(timeout=60)
    assert second[0].returncode == 0, err[-3000:]
    assert f"resumed from step {newest}" in out, out[-2000:]
    assert again.returncode == 0

    _, ref_err = reference.communicate(timeout=240)
    assert reference.returncode == 0, ref_err[-2000:]
    expected = dict(enumerate(losses(tmp_path / "one"), start=1))
    assert len(expected) == STEPS
    for step, loss in [*seen.items(), *((r["step"], r["loss"]) for r in metrics(run_dir))]:
        assert loss == expected[step], (step, loss, expected[step])
    assert max(r["step"] for r in metrics(run_dir)) == STEPS
    assert losses(slurm(tmp_path, nodes)) == [expected[s] for s in range(1, STEPS + 1)]


def slurm(tmp_path: Path, cluster: Cluster) -> Path:
    """The rendered sbatch file run by bash with the job's variables and the stand-in
    srun; its run directory."""
    run_dir = tmp_path / "slurm"
    rendered = fsdpkit("train", "--slurm-script", "--nnodes", "2", "--nproc", "1", *ARGS,
                       f"logging.run_dir={run_dir}", cwd=tmp_path)  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    assert "#SBATCH --nodes=2" in rendered.stdout
    (tmp_path / "job.sbatch").write_text(rendered.stdout)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text(SRUN.format(python=sys.executable))
    (tmp_path / "bin" / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "SLURM"))}
    env.update(
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}",
        PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")]),
        FSDPKIT_TEST_NETNS=",".join(n.netns for n in cluster.nodes),
        SLURM_JOB_ID="4242",  # MASTER_PORT 14242: nothing else listens inside the nodes
        SLURM_NTASKS="2",
        SLURM_NNODES="2",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NODELIST=cluster.hostlist(),
        SLURM_TASKS_PER_NODE="1(x2)",
    )
    job = subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    return run_dir
