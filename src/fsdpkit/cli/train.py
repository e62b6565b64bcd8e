"""``fsdpkit train [CONFIG.toml] [key=value ...] [--nproc N]``: the main job.

    fsdpkit train            # built-in default: tiny Llama, stdlib corpus, 2 CPU ranks
    fsdpkit train run.toml train.steps=50 parallel.strategy=hybrid
    torchrun --nproc-per-node 8 -m fsdpkit train run.toml   # joins instead of spawning
    srun python -m fsdpkit train run.toml                   # SLURM: joins, one task per rank
    fsdpkit train --slurm-script --nnodes 4 --nproc 8 run.toml > job.sbatch

The config, the machine's room for the workers and the run directory are checked, and
the run directory locked, before any process starts; under torchrun/SLURM this
process is a worker and joins. Ctrl-C, SIGHUP and SIGTERM stop at the next step
boundary with a checkpoint (exit 130 / 129 / 143); a second Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fsdpkit.cli.configargs import add_config_items, split_items
from fsdpkit.errors import UserError

if TYPE_CHECKING:  # the library is imported by the command run, not by `fsdpkit --help`
    from fsdpkit.config import RunConfig
    from fsdpkit.run.resolve import Resolved


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
        "--local-addr",
        default=None,
        help="multi-node: this machine's address the other nodes reach; every listener "
        "binds to it (default: the address on the route to --rdzv-endpoint)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all workers up to N times after a failure (resumes from the "
        "newest complete checkpoint)",
    )
    p.add_argument(
        "--slurm-script",
        action="store_true",
        help="print an sbatch file that runs this command under SLURM (--nnodes nodes x "
        "--nproc tasks) and exit",
    )
    p.add_argument("--help-config", action="store_true", help="print every config key and exit")
    p.set_defaults(func=run)


def _check_topology(args: argparse.Namespace, nproc: int) -> None:
    if nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {nproc}.")
    if args.nnodes < 1:
        raise UserError(f"--nnodes must be >= 1, got {args.nnodes}.")
    if args.nnodes > 1 and not args.rdzv_endpoint and not args.slurm_script:
        raise UserError(
            f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node "
            "(a port on the first node that all nodes can reach)."
        )


def run(args: argparse.Namespace) -> int:
    from fsdpkit.config import load
    from fsdpkit.run.resolve import resolve
    from fsdpkit.runtime.distenv import bind_worker_lifetime, default_nproc, joined_env

    if args.help_config:
        from fsdpkit.config import describe

        print(describe())
        return 0
    path, overrides = split_items(args.items)
    env = joined_env() if not args.slurm_script else None
    if env is not None:
        bind_worker_lifetime(env)  # first: a worker must never outlive its launcher
        from fsdpkit.run.worker import main

        main(path, overrides, env)  # never returns
    load(path, overrides)  # the config's own errors first: counting GPUs imports torch
    nproc = default_nproc() if args.nproc is None else args.nproc
    _check_topology(args, nproc)
    resolved = resolve(path, overrides, world_size=nproc * args.nnodes, local_world_size=nproc)
    if args.slurm_script:
        return _print_slurm_script(args, nproc)
    if resolved.auto_changes is not None:
        _print_auto(resolved.auto_changes, note=resolved.auto_note)
    _check_capacity(resolved.config, nproc=nproc, nnodes=args.nnodes)
    _check_compile(resolved.config)
    return _launch(args, resolved, nproc=nproc)


def _launch(args: argparse.Namespace, resolved: Resolved, *, nproc: int) -> int:
    """Lock the run directory and spawn this node's workers."""
    from fsdpkit.runtime.hangs import hang_timeout
    from fsdpkit.runtime.launch import SpawnOptions, spawn
    from fsdpkit.runtime.rundir import check_run_dir
    from fsdpkit.runtime.runlock import acquire

    run_dir = Path(resolved.config.logging.run_dir)
    check_run_dir(run_dir)
    opts = SpawnOptions(
        nproc=nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        max_restarts=args.max_restarts,
        run_dir=run_dir,
        local_addr=args.local_addr,
        lock_held=args.nnodes == 1,
        timeout_s=resolved.config.parallel.timeout_s,
        hang_timeout_s=hang_timeout(
            resolved.config.parallel.timeout_s, resolved.config.parallel.hang_timeout_s
        ),
    )
    if args.nnodes > 1:  # rank 0 takes the lock: nodes share one run dir ([Note: run-dir lock])
        return spawn(args.items, opts)
    with acquire(run_dir):
        return spawn(args.items, opts)


def _check_capacity(cfg: RunConfig, *, nproc: int, nnodes: int) -> None:
    from fsdpkit.devices import device_type, local_gpus
    from fsdpkit.runtime.capacity import capacity

    room = capacity(cfg, nproc=nproc, nnodes=nnodes, device=device_type(), gpus=local_gpus())
    warning = room.warning()
    if warning:
        print(f"fsdpkit train: {warning}", file=sys.stderr)
    room.check_memory()


def _check_compile(cfg: RunConfig) -> None:
    """train.compile without inductor's toolchain fails before any worker starts (the
    doctor's check: fsdpkit.doctor.environment.check_compile)."""
    if not cfg.train.compile:
        return
    import os

    from fsdpkit.devices import local_gpus
    from fsdpkit.doctor.environment import check_compile
    from fsdpkit.doctor.facts import compile_toolchain

    toolchain = compile_toolchain(os.environ)
    check = check_compile(gpu=bool(local_gpus()), compile_blocks=True, **toolchain)
    if check.status == "fail":
        raise UserError(
            f"{check.message}. Fix: {check.fix}. (`fsdpkit doctor` runs the same check: "
            f"'{check.name}'.)"
        )


def _print_slurm_script(args: argparse.Namespace, nproc: int) -> int:
    from fsdpkit.devices import local_gpus
    from fsdpkit.runtime.slurm import sbatch_script

    print(
        sbatch_script(
            items=args.items, nodes=args.nnodes, tasks_per_node=nproc, gpus=local_gpus() > 0
        ),
        end="",
    )
    return 0


def _print_auto(changes: dict[str, object], *, note: str | None) -> None:
    from fsdpkit.config.toml import toml_value

    if note is not None:
        print(f"fsdpkit train: {note}")
        return
    chosen = " ".join(f"{k}={toml_value(v)}" for k, v in changes.items() if v is not None)
    print(f"fsdpkit train: parallel.auto chose {chosen or 'the config as given'}")
