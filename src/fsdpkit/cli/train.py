"""``fsdpkit train [CONFIG.toml] [key=value ...] [--nproc N]``: the main job.

    fsdpkit train            # built-in default: tiny Llama, stdlib corpus, 2 CPU ranks
    fsdpkit train run.toml train.steps=50 parallel.strategy=hybrid
    torchrun --nproc-per-node 8 -m fsdpkit train run.toml   # joins instead of spawning

The config is resolved and validated before any process starts; under torchrun/SLURM
this process is a worker and joins.
"""

from __future__ import annotations

import argparse

from fsdpkit import config as configuration
from fsdpkit.cli.configargs import add_config_items, split_items
from fsdpkit.config.toml import toml_value
from fsdpkit.errors import UserError
from fsdpkit.launch import SpawnOptions, default_nproc, joined_env, spawn


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model with FSDP2 (built-in default without arguments)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_items(p, example="train.steps=50")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local worker processes (default: GPUs, or 2 on CPU)",
    )
    p.add_argument("--nnodes", type=int, default=1, help="machines in the job")
    p.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this machine's rank (static rendezvous); omit for elastic c10d",
    )
    p.add_argument(
        "--rdzv-endpoint",
        default=None,
        help="host:port of the rendezvous (default 127.0.0.1 with a free port)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all workers up to N times after a failure (resumes from the "
        "newest complete checkpoint)",
    )
    p.add_argument("--help-config", action="store_true", help="print every config key and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.help_config:
        print(configuration.describe())
        return 0
    path, overrides = split_items(args.items)
    env = joined_env()
    if env is not None:
        from fsdpkit.train.worker import main

        main(path, overrides, env)  # never returns
    nproc = default_nproc() if args.nproc is None else args.nproc
    if nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {nproc}.")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise UserError(
            f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node "
            "(a port on the first node that all nodes can reach)."
        )
    resolved = configuration.resolve(
        path, overrides, world_size=nproc * args.nnodes, local_world_size=nproc
    )
    if resolved.auto_changes is not None:
        _print_auto(resolved.auto_changes)
    opts = SpawnOptions(
        nproc=nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        max_restarts=args.max_restarts,
    )
    return spawn(args.items, opts)


def _print_auto(changes: dict[str, object]) -> None:
    chosen = " ".join(f"{k}={toml_value(v)}" for k, v in changes.items() if v is not None)
    print(f"fsdpkit train: parallel.auto chose {chosen or 'the config as given'}")
