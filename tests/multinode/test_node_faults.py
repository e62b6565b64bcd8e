"""Faults between two namespace "nodes" (tests/netns.py) that loopback hides:
a cut link, a rank of node 1 asleep inside a step, a node that cannot route to the
rendezvous (``fsdpkit doctor --nnodes 2``).

The cut link and the hang run at once (they mostly wait); each side must stop by
itself with a named error within ``parallel.timeout_s`` + ``MARGIN_S``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from clirun import FAST, cli_env, wait_for_step

import netns
from fsdpkit.checkpoint.stepdir import complete_entries
from netns import Cluster

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT_S = 10.0
MARGIN_S = 15.0
"""Measured: node 0 ~12 s after the cut (stall watch at 0.9 x timeout + collecting),
node 1 ~15 s (its store request's timeout + stopping)."""
ARGS = [
    *[a for a in FAST if not a.startswith(("train.steps", "train.eval"))],
    "train.steps=40",
    "train.eval_every=0",
    "checkpoint.every=3",
    "logging.progress=none",
    f"parallel.timeout_s={TIMEOUT_S:g}",
]


def _start(cluster: Cluster, run_dir: Path, nproc: int, env: dict[str, str], *extra: str) -> list:
    endpoint = f"{cluster.nodes[0].address}:29500"
    argv = [sys.executable, "-m", "fsdpkit", "train", "--nnodes", "2", "--nproc", str(nproc),
            "--rdzv-endpoint", endpoint, *ARGS, *extra, f"logging.run_dir={run_dir}"]  # fmt: skip
    return [
        subprocess.Popen(n.command(argv), env=cli_env(env), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for n in cluster.nodes
    ]  # fmt: skip


def _said(proc: subprocess.Popen[str], *, within_s: float) -> tuple[str, float]:
    """The one line fsdpkit printed on stderr (c10d's C++ warnings left out), and
    when the process ended (monotonic)."""
    _, err = proc.communicate(timeout=within_s + 60)
    ended = time.monotonic()
    lines = [x for x in err.strip().splitlines() if x.startswith("fsdpkit train:")]
    assert proc.returncode == 1 and len(lines) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return lines[0], ended


def test_a_cut_link_and_a_rank_asleep_on_node_1_stop_both_nodes_naming_it(
    tmp_path: Path, nodes: Cluster
) -> None:
    with netns.cluster(nodes=2) as other:
        cut_dir, hang_dir = tmp_path / "cut", tmp_path / "hang"
        slow = {"FSDPKIT_TEST_FORWARD_DELAY": "0.3"}
        cut = _start(nodes, cut_dir, 1, slow, "model.factory=factories:sluggish")
        hang_env = {"FSDPKIT_TEST_HANG_RANK": "3", "FSDPKIT_TEST_HANG_MARK": str(tmp_path / "m")}
        hang = _start(other, hang_dir, 2, hang_env, "model.factory=factories:hanging")

        wait_for_step(cut_dir, 4, cut[0], timeout=240)
        nodes.nodes[1].link(up=False)
        t_cut = time.monotonic()
        said0, end0 = _said(cut[0], within_s=TIMEOUT_S + MARGIN_S)
        said1, end1 = _said(cut[1], within_s=TIMEOUT_S + MARGIN_S)
        assert "the run hung: on node 0" in said0 and "network" in said0, said0
        assert f"lost the rendezvous at {nodes.nodes[0].address}:29500" in said1, said1
        assert end0 - t_cut < TIMEOUT_S + MARGIN_S and end1 - t_cut < TIMEOUT_S + MARGIN_S
        assert nodes.kill_all(grace_s=5) == []  # nothing left in either node
        saved = [p.name for p in (cut_dir / "checkpoints").glob("step-*") if "." not in p.name]
        complete = complete_entries(cut_dir)
        assert complete and sorted(saved) == [e.path.name for e in complete]  # none torn
        assert f"newest complete checkpoint is step {complete[-1].step}" in said0

        lines = [_said(p, within_s=240)[0] for p in hang]
        asleep = float((tmp_path / "m").read_text())
        behind = [x for x in lines if "Rank 3 is behind" in x]
        assert len(behind) == 1 and "on node 1 (" in behind[0], lines
        assert "asleep_inside_a_step" in behind[0] and "rank 2 waits" in behind[0], behind
        report = hang_dir / "hang" / "report-node1.txt"
        assert str(report) in behind[0] and report.stat().st_mtime - asleep < TIMEOUT_S + 5
        assert (hang_dir / "hang" / "report-node0.txt").is_file()
        assert other.kill_all(grace_s=5) == []


def test_doctor_on_two_nodes_and_a_node_without_a_route(nodes: Cluster) -> None:
    endpoint = f"{nodes.nodes[0].address}:29600"
    argv = [sys.executable, "-m", "fsdpkit", "doctor", "--nnodes", "2", "--nproc", "1",
            "--rdzv-endpoint", endpoint, "--timeout", "20"]  # fmt: skip
    procs = [
        subprocess.Popen(n.command(argv), env=cli_env(), stdout=subprocess.PIPE, text=True)
        for n in nodes.nodes
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for node, (proc, out) in enumerate(zip(procs, outs, strict=True)):
        assert proc.returncode == 0, out[-3000:]
        out = " ".join(out.split())
        assert f"{endpoint} reached as node {node} of 2" in out, out[-3000:]
        assert "all 2 nodes: torch" in out and "all-reduce over 2 node(s) x 1 rank(s)" in out

    nodes.nodes[1].drop_route()  # what a firewall or a wrong network looks like from node 1
    quick = [*argv[:-1], "5"]  # --timeout 5: it waits that long whatever the error
    alone = subprocess.run(
        nodes.nodes[1].command(quick), env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert alone.returncode == 1, alone.stdout[-3000:]
    out = " ".join(alone.stdout.split())  # the report wraps its lines
    assert f"FAIL rendezvous cannot reach the rendezvous at {endpoint} within 5 s" in out, out
    assert "Network is unreachable" in out and "firewalls let TCP through" in out, out
