"""``fsdpkit doctor``: check the machine, the model and the cluster before training.

    fsdpkit doctor                                   # this machine
    fsdpkit doctor run.toml --world-size 64 --device-mem h100   # + model checks
    fsdpkit doctor --bandwidth                       # + all-reduce benchmark on local ranks
    fsdpkit doctor --nnodes 2 --rdzv-endpoint node0:29400      # on every node
    fsdpkit doctor run.toml --json                   # for scripts

Every check says ok, WARN, FAIL or -- (not applicable here) and what to do. The exit
code is 1 when any check failed, 0 otherwise (2 for a bad config or option).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from fsdpkit.cli.configargs import add_config_items, split_items
from fsdpkit.errors import UserError

if TYPE_CHECKING:  # the library is imported by the command run, not by `fsdpkit --help`
    from fsdpkit.doctor.examine import NetworkOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check the environment, a model config and multi-node networking",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_items(p, example="as for fsdpkit train; given = model checks too")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default nproc x nnodes)")
    p.add_argument("--nproc", type=int, default=None, help="ranks per node (default: GPUs, or 2)")
    p.add_argument("--device-mem", default=None, metavar="SIZE|NAME", help="as for fsdpkit plan")
    p.add_argument("--no-trace", action="store_true", help="skip the fake-tensor dry run")
    p.add_argument("--bandwidth", action="store_true", help="all-reduce benchmark on local ranks")
    p.add_argument("--nnodes", type=int, default=1, help="nodes to check together (default 1)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="same on every node")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (default: any)")
    p.add_argument("--timeout", type=float, default=60.0, help="network timeout in s (default 60)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a report")
    p.set_defaults(func=run)


def _network(args: argparse.Namespace) -> NetworkOptions | None:
    """The network part, when asked for (--bandwidth, --nnodes > 1, an endpoint)."""
    if args.nnodes < 1:
        raise UserError(f"--nnodes must be >= 1, got {args.nnodes}.")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise UserError(
            f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node "
            "(an address of one node that all nodes can reach, and a free port)."
        )
    from fsdpkit.doctor.examine import NetworkOptions

    if args.nnodes == 1 and not args.rdzv_endpoint:
        from fsdpkit.doctor.slurmjob import network_options

        found = network_options(os.environ)  # one srun task per node: SLURM's endpoint
        if found is not None:
            endpoint, nnodes, node_rank = found
            return NetworkOptions(endpoint, nnodes, node_rank, timeout_s=args.timeout)
    if args.nnodes == 1 and not args.bandwidth and not args.rdzv_endpoint:
        return None

    return NetworkOptions(
        endpoint=args.rdzv_endpoint,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        timeout_s=args.timeout,
    )


def run(args: argparse.Namespace) -> int:
    from fsdpkit import config as configuration
    from fsdpkit.doctor import failed, format_report, report_dict, run_doctor
    from fsdpkit.planner.search.auto import auto_device
    from fsdpkit.runtime.distenv import default_nproc

    path, overrides = split_items(args.items)
    cfg = configuration.load(path, overrides)
    nproc = args.nproc if args.nproc is not None else default_nproc()
    if nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {nproc}.")
    world = args.world_size or nproc * args.nnodes
    if args.device_mem:
        cfg = configuration.with_changes(
            cfg, {"parallel.device_mem": args.device_mem}, source="--device-mem"
        )
    checks = run_doctor(
        cfg,
        environ=os.environ,
        nproc=nproc,
        world_size=world,
        model=bool(args.items),
        device=auto_device(cfg, local_world_size=nproc) if args.items else None,
        trace=not args.no_trace,
        network=_network(args),
    )
    if args.json:
        json.dump(report_dict(checks, world_size=world, nproc=nproc), sys.stdout, indent=2)
        print()
    else:
        print(format_report(checks))
    return 1 if failed(checks) else 0
