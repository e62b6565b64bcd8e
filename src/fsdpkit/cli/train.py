"""``fsdpkit train [CONFIG.toml] [key=value ...] [--nproc N]``: the main job.

    fsdpkit train            # built-in default: tiny Llama, stdlib corpus, 2 CPU ranks
    fsdpkit train run.toml train.steps=50 parallel.strategy=hybrid
    torchrun --nproc-per-node 8 -m fsdpkit train run.toml   # joins instead of spawning

The config is validated before any process starts; under torchrun/SLURM this process
is a worker and joins.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from fsdpkit import config as configuration
from fsdpkit.cli.autoconfig import auto_overrides
from fsdpkit.cli.configargs import add_config_items, split_items
from fsdpkit.errors import UserError
from fsdpkit.launch import DistEnv, SpawnOptions, default_nproc, joined_env, spawn, write_error

PREEMPTED_EXIT = 128 + 15  # like a process ended by SIGTERM


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
        _work(path, overrides, env)  # never returns
    cfg = configuration.load(path, overrides)
    nproc = default_nproc() if args.nproc is None else args.nproc
    if nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {nproc}.")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise UserError(
            f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node "
            "(a port on the first node that all nodes can reach)."
        )
    auto = auto_overrides(cfg, world_size=nproc * args.nnodes, local_world_size=nproc)
    if auto:
        print(f"fsdpkit train: parallel.auto chose {' '.join(auto[:-1]) or 'the config as given'}")
        cfg = configuration.load(path, overrides + auto)
    configuration.validate_for_world(cfg, world_size=nproc * args.nnodes, local_world_size=nproc)
    opts = SpawnOptions(
        nproc=nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        max_restarts=args.max_restarts,
    )
    return spawn(args.items + auto, opts)


def _worker_config(path: str | None, overrides: list[str], env: DistEnv) -> configuration.RunConfig:
    """The config as the launcher resolved it (parallel.auto is deterministic)."""
    cfg = configuration.load(path, overrides)
    auto = auto_overrides(cfg, world_size=env.world_size, local_world_size=env.local_world_size)
    if auto:
        cfg = configuration.load(path, overrides + auto)
    configuration.validate_for_world(
        cfg, world_size=env.world_size, local_world_size=env.local_world_size
    )
    return cfg


def _work(path: str | None, overrides: list[str], env: DistEnv) -> None:
    """Worker body: train, print the summary on rank 0, and leave with os._exit (gloo
    can abort during interpreter shutdown otherwise). A run stopped early by SIGTERM
    exits 143 so schedulers do not take it for finished."""
    code = 0
    # The built-in loss never modifies logits in place, which is what this warns about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    try:
        cfg = _worker_config(path, overrides, env)
        from fsdpkit.train.loop import run as train
        from fsdpkit.train.report import print_summary

        summary = train(cfg, env)
        if env.rank == 0:
            print_summary(summary, cfg=cfg)
        _shutdown()
        code = PREEMPTED_EXIT if summary.steps < cfg.train.steps else 0
    except UserError as exc:
        write_error(exc, rank=env.rank, user=True)
        code = 2
    except BaseException as exc:
        write_error(exc, rank=env.rank, user=False)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
