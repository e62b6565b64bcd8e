"""``fsdpkit doctor``'s network checks in this process: a rendezvous on loopback, nodes
that never join, unreachable and foreign endpoints, version disagreement, and the
all-reduce benchmark on spawned local ranks (and when peers never connect)."""

from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path

import pytest

from fsdpkit.doctor.bandwidth import benchmark, check_bandwidth
from fsdpkit.doctor.examine import NetworkOptions, network_checks
from fsdpkit.doctor.facts import gather
from fsdpkit.doctor.network import Endpoint, NodeInfo, check_agreement, connect, exchange

pytestmark = pytest.mark.distributed

NODE = NodeInfo(0, "n0", "2.13.0+cu128", "0.1.0", "3.11", "12.8", "2.27.3", 8, "cuda")


def test_bandwidth_on_spawned_local_ranks(tmp_path: Path) -> None:
    facts = gather(environ={}, run_dir=tmp_path, local_ranks=2)
    checks = network_checks(facts, NetworkOptions(timeout_s=60), nproc=2)
    assert [c.status for c in checks] == ["ok"] * 4, checks
    rendezvous, _, versions, allreduce = checks
    assert "reached as node 0 of 1 (hosting it)" in rendezvous.message
    assert rendezvous.message.startswith("127.0.0.1:")
    assert "2 rank(s) on cpu" in versions.message
    assert "all-reduce over 1 node(s) x 2 rank(s) (gloo): 1 MiB:" in allreduce.message
    assert "16 MiB:" in allreduce.message


def test_nodes_that_never_join_and_ranks_that_never_connect() -> None:
    rdzv, reached = connect(Endpoint("127.0.0.1", 0), nnodes=2, node_rank=None, timeout_s=2)
    assert rdzv is not None and reached.status == "ok"
    try:
        nodes, joined = exchange(rdzv, NODE, timeout_s=1)
        assert nodes is None and joined.status == "fail"
        assert "only 1 of 2 nodes joined" in joined.message and "[1]" in joined.message
        result = benchmark(rdzv, nproc=1, timeout_s=2)  # world 2: rank 1 never comes
        assert result.status == "fail" and "benchmark failed on rank 0" in result.message
        assert "GLOO_SOCKET_IFNAME" in result.fix
    finally:
        rdzv.close(timeout_s=0.1)


def test_unreachable_and_foreign_endpoints() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    rdzv, check = connect(Endpoint("127.0.0.1", port), nnodes=2, node_rank=1, timeout_s=1)
    assert rdzv is None and check.status == "fail"
    assert "connection refused (nothing listens on that port)" in check.message
    with socket.create_server(("127.0.0.1", 0)) as foreign:  # accepts, never answers
        endpoint = Endpoint("127.0.0.1", foreign.getsockname()[1])
        rdzv, check = connect(endpoint, nnodes=2, node_rank=None, timeout_s=1)
    assert rdzv is None and "does not answer as a rendezvous store" in check.message


def test_nodes_must_agree_on_versions() -> None:
    assert check_agreement([NODE, replace(NODE, node_rank=1, hostname="n1")]).status == "ok"
    other = replace(NODE, node_rank=1, torch_version="2.12.1+cu126", nproc=4)
    check = check_agreement([NODE, other])
    assert check.status == "fail"
    assert "torch_version: node 0=2.13.0+cu128, node 1=2.12.1+cu126" in check.message
    assert "nproc: node 0=8, node 1=4" in check.message


def test_slow_nccl_across_nodes_is_flagged() -> None:
    record = {"backend": "nccl", "results": [{"nbytes": 2**26, "seconds": 0.1, "world": 16}]}
    assert check_bandwidth(record, nnodes=2, nproc=8).status == "warn"
    assert check_bandwidth({**record, "backend": "gloo"}, nnodes=2, nproc=8).status == "ok"
