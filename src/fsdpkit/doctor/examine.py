"""``run_doctor``: every check the command line asked for, each tagged with its
section. Gathering facts, model building and networking happen here; the checks
themselves are pure functions in the other modules."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpkit.config import RunConfig
from fsdpkit.doctor.bandwidth import benchmark
from fsdpkit.doctor.check import Check
from fsdpkit.doctor.data_check import dataset_checks
from fsdpkit.doctor.diagnose import model_checks
from fsdpkit.doctor.environment import environment_checks
from fsdpkit.doctor.facts import EnvFacts, gather
from fsdpkit.doctor.network import (
    Endpoint,
    NodeInfo,
    check_agreement,
    connect,
    exchange,
    parse_endpoint,
)
from fsdpkit.doctor.slurmjob import slurm_checks


@dataclass(frozen=True)
class NetworkOptions:
    """Multi-node / bandwidth part of a doctor run."""

    endpoint: str | None = None
    """HOST:PORT of the rendezvous; None = a free loopback port (one node)."""
    nnodes: int = 1
    node_rank: int | None = None
    timeout_s: float = 60.0


def network_checks(facts: EnvFacts, opts: NetworkOptions, *, nproc: int) -> list[Check]:
    """Reach the rendezvous, agree on versions, measure all-reduce bandwidth."""

    endpoint = parse_endpoint(opts.endpoint) if opts.endpoint else Endpoint("127.0.0.1", 0)
    rdzv, reached = connect(
        endpoint, nnodes=opts.nnodes, node_rank=opts.node_rank, timeout_s=opts.timeout_s
    )
    if rdzv is None:
        return [reached]
    checks = [reached]
    try:
        info = NodeInfo(
            node_rank=rdzv.node_rank,
            hostname=socket.gethostname(),
            torch_version=facts.torch_version,
            fsdpkit_version=facts.fsdpkit_version,
            python_version=".".join(facts.python_version.split(".")[:2]),
            cuda_version=facts.cuda_version,
            nccl_version=facts.nccl_version,
            nproc=nproc,
            device="cuda" if facts.gpus else "cpu",
        )
        nodes, joined = exchange(rdzv, info, timeout_s=opts.timeout_s)
        checks.append(joined)
        if nodes is not None:
            agreement = check_agreement(nodes)
            checks.append(agreement)
            if agreement.status != "fail":
                checks.append(benchmark(rdzv, nproc=nproc, timeout_s=opts.timeout_s))
    finally:
        rdzv.close(timeout_s=opts.timeout_s)
    return checks


def _tag(checks: list[Check], section: str) -> list[Check]:
    return [dataclasses.replace(c, section=section) for c in checks]


def run_doctor(
    cfg: RunConfig,
    *,
    environ: Mapping[str, str],
    nproc: int,
    world_size: int,
    model: bool,
    device: Any = None,
    trace: bool = True,
    network: NetworkOptions | None = None,
) -> list[Check]:
    """Environment checks, then model checks (``model``), then network checks
    (``network``), in report order."""
    facts = gather(environ=environ, run_dir=Path(cfg.logging.run_dir), local_ranks=nproc)
    model_part: list[Check] = []
    need = None
    if model:
        model_part, per_checkpoint = model_checks(
            cfg, world_size=world_size, device=device, trace=trace
        )
        if per_checkpoint is not None and cfg.checkpoint.every > 0:
            need = per_checkpoint * (cfg.checkpoint.keep + 1)  # the newest is written first
        elif per_checkpoint is not None:
            need = 0
    checks = _tag(
        environment_checks(
            facts,
            precision=cfg.precision.mode,
            checkpoint_bytes=need,
            compile_blocks=cfg.train.compile,
        ),
        "environment",
    )
    checks += _tag(slurm_checks(environ), "slurm")
    checks += _tag(dataset_checks(cfg), "data")
    checks += _tag(model_part, f"model (world size {world_size})")
    if network is not None:
        checks += _tag(network_checks(facts, network, nproc=nproc), "network")
    return checks
