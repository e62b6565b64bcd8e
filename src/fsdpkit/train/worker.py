"""The body of one training worker: resolve the config, train, report, exit.

``fsdpkit train`` runs this in every process the launcher spawns, and in every
process torchrun or SLURM starts (they join). It resolves the config exactly as the
launcher did (``fsdpkit.config.resolve``), builds the session, runs the loop, prints
the summary on rank 0 and leaves with ``os._exit`` (gloo can abort during interpreter
shutdown otherwise; see ../shared/cpu-fsdp-facts.md). Errors are recorded for the
launcher's root-cause report (``fsdpkit.launch.write_error``).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

from fsdpkit.config import resolve
from fsdpkit.errors import UserError
from fsdpkit.launch import DistEnv, write_error

PREEMPTED_EXIT = 128 + 15
"""A run stopped early by SIGTERM exits like a process ended by it, so schedulers do
not take it for finished."""


def train_worker(path: str | None, overrides: Sequence[str], env: DistEnv) -> int:
    """Train on this rank; the exit code (0 done, 143 stopped early). Raises on errors."""
    import torch.distributed as dist

    from fsdpkit.observe.observer import Observer
    from fsdpkit.train.loop import run
    from fsdpkit.train.session import build_session
    from fsdpkit.train.summary import print_summary

    cfg = resolve(
        path, overrides, world_size=env.world_size, local_world_size=env.local_world_size
    ).config
    obs = Observer(cfg, env)  # before the model exists: CPU tensor memory for the profiler
    summary = run(build_session(cfg, env), obs=obs)
    if env.rank == 0:
        print_summary(summary, cfg=cfg)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return PREEMPTED_EXIT if summary.steps < cfg.train.steps else 0


def main(path: str | None, overrides: Sequence[str], env: DistEnv) -> NoReturn:
    """Run ``train_worker`` and exit the process with its code (2 for a user error,
    1 for anything else, after recording the error for the launcher)."""
    # The built-in loss never modifies logits in place, which is what this warns about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    try:
        code = train_worker(path, overrides, env)
    except UserError as exc:
        write_error(exc, rank=env.rank, user=True)
        code = 2
    except BaseException as exc:
        write_error(exc, rank=env.rank, user=False)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
