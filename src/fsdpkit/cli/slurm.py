"""``fsdpkit slurm [CONFIG.toml] [key=value ...] --nodes N --tasks-per-node T``: train
under SLURM.

    fsdpkit slurm run.toml --nodes 4 --tasks-per-node 8 --time 12:00:00 --partition gpu
    fsdpkit slurm run.toml --nodes 2 --tasks-per-node 1 --print > job.sbatch

Checks the config for nodes x tasks ranks (what ``fsdpkit train`` checks before any
worker starts), writes ``RUN_DIR/job.sbatch`` and submits it with ``sbatch``. In the
job, ``srun`` starts one ``fsdpkit train`` task per rank; they rendezvous from
SLURM's variables (the first node of the allocation hosts the store). SIGUSR1
``--grace`` seconds before ``--time`` runs out (or a preemption's SIGTERM) saves the
current step; with ``--requeue`` (the default) the job then requeues itself and
resumes from that step. SLURM's log: ``RUN_DIR/slurm-JOBID.out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdpkit.cli.configargs import add_config_items, split_items


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "slurm",
        help="write an sbatch script for a training config and submit it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_items(p, example="as for fsdpkit train")
    p.add_argument("--nodes", type=int, default=1, help="nodes to allocate (default 1)")
    p.add_argument(
        "--tasks-per-node", type=int, default=1, help="ranks per node: one per GPU (default 1)"
    )
    p.add_argument("--time", default=None, help="time limit: MM, MM:SS, HH:MM:SS or D-HH:MM:SS")
    p.add_argument("--partition", default=None, help="SLURM partition (default: the cluster's)")
    p.add_argument(
        "--requeue",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="requeue the job after a stop signal saved a step, to resume from it (default on)",
    )
    p.add_argument(
        "--signal",
        default="USR1",
        choices=["USR1", "TERM"],
        help="signal SLURM sends --grace seconds before the time limit (default USR1)",
    )
    p.add_argument(
        "--grace", type=int, default=120, help="seconds between that signal and the time limit"
    )
    p.add_argument("--job-name", default="fsdpkit")
    p.add_argument("--gpus", action="store_true", help="one GPU per task (--gpus-per-node)")
    p.add_argument(
        "--python", default=sys.executable, help="the interpreter the tasks run (default: this one)"
    )
    p.add_argument("--print", action="store_true", help="print the script instead of submitting")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fsdpkit.run.resolve import resolve
    from fsdpkit.runtime.sbatch import JobSpec, check_spec, render, write_and_submit

    path, overrides = split_items(args.items)
    spec = JobSpec(
        items=tuple(args.items), nodes=args.nodes, tasks_per_node=args.tasks_per_node,
        time=args.time, partition=args.partition, requeue=args.requeue, signal=args.signal,
        grace_s=args.grace, job_name=args.job_name, gpus=args.gpus, python=args.python,
    )  # fmt: skip
    check_spec(spec)
    cfg = resolve(
        path, overrides, world_size=spec.world_size, local_world_size=spec.tasks_per_node
    ).config
    spec = spec.with_run_dir(Path(cfg.logging.run_dir).absolute())
    if args.print:
        print(render(spec), end="")
        return 0
    script, job_id = write_and_submit(spec)
    print(f"fsdpkit slurm: submitted job {job_id}: {script}")
    print(f"fsdpkit slurm: log {spec.log_of(job_id)}; status: squeue -j {job_id}")
    return 0
