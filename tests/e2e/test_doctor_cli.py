"""``fsdpkit doctor`` as users run it: two "nodes" on loopback (two processes), one with
a config whose model shares a parameter across blocks and an oversubscribed
OMP_NUM_THREADS, both measuring all-reduce bandwidth across the pair."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from clirun import fsdpkit

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_two_nodes_on_loopback_with_model_checks(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["doctor", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc", "1"]
    node0 = [
        *common,
        "model.factory=doctor_factories:shared_across_blocks",
        "checkpoint.every=10",
        f"logging.run_dir={tmp_path / 'run'}",
        "--json",
    ]
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(
            fsdpkit, *node0, cwd=tmp_path, timeout=180, env={"OMP_NUM_THREADS": "64"}
        )
        second = pool.submit(fsdpkit, *common, cwd=tmp_path, timeout=180)
        r0, r1 = first.result(), second.result()
    assert r0.returncode == 1, r0.stderr[-2000:]  # the oversubscribed threads fail
    report = json.loads(r0.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is False and report["world_size"] == 2
    assert checks["env OMP_NUM_THREADS"]["status"] == "fail"
    assert "oversubscribed" in checks["env OMP_NUM_THREADS"]["message"]
    assert checks["shared params"]["status"] == "warn"
    assert checks["shared params"]["section"] == "model (world size 2)"
    assert "checkpoints need" in checks["disk"]["message"]
    # whichever process binds the endpoint first hosts the rendezvous as node 0
    hosting = checks["rendezvous"]["message"].endswith("as node 0 of 2 (hosting it)")
    assert hosting or checks["rendezvous"]["message"].endswith("as node 1 of 2 (connected)")
    for name in ("nodes joined", "versions", "all-reduce"):
        assert checks[name]["status"] == "ok", checks[name]
    assert "all-reduce over 2 node(s) x 1 rank(s) (gloo)" in checks["all-reduce"]["message"]
    assert r1.returncode == 0, r1.stdout[-3000:] + r1.stderr[-2000:]
    other = "as node 1 of 2 (connected)" if hosting else "as node 0 of 2 (hosting it)"
    assert other in r1.stdout
    assert "all-reduce over 2 node(s) x 1 rank(s) (gloo): 1 MiB:" in r1.stdout
    assert "clock skew" in r1.stdout and "not checkable" in r1.stdout
