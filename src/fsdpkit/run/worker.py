"""The body of one training worker: resolve the config, train, report, exit.

``fsdpkit train`` runs this in every process the launcher spawns, and in every
process torchrun or SLURM starts (they join). It installs the stop-signal flag first
(a Ctrl-C during setup then stops cleanly too), resolves the config exactly as the
launcher did (``fsdpkit.run.resolve``), builds the session, runs the loop, prints
the summary on rank 0 and leaves with ``os._exit`` (gloo can abort during interpreter
shutdown otherwise; see ../shared/cpu-fsdp-facts.md). Errors are recorded for the
launcher's root-cause report (``fsdpkit.runtime.distenv.write_error``), and rank 0 reports
how the run ended and what a stop signal saved (``fsdpkit.runtime.distenv.report_outcome``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from fsdpkit.errors import UserError
from fsdpkit.observe.observer import Observer
from fsdpkit.run.resolve import resolve
from fsdpkit.runtime.distenv import DistEnv, report_outcome, set_env_defaults, write_error
from fsdpkit.runtime.hangs import HangProbe
from fsdpkit.runtime.hangs.flight import prepare
from fsdpkit.runtime.hangs.probe import HANG_DIR
from fsdpkit.runtime.signals import StopFlag, install_stop_flag
from fsdpkit.train.loop import run
from fsdpkit.train.session import build_session
from fsdpkit.train.summary import print_summary

if TYPE_CHECKING:
    from fsdpkit.config import RunConfig
    from fsdpkit.runtime.hangs import HangProbe


def train_worker(
    path: str | None, overrides: Sequence[str], env: DistEnv, *, stop: StopFlag | None = None
) -> int:
    """Train on this rank; the exit code (0 done, 128 + N when signal N stopped the run
    early: 143 SIGTERM, 130 SIGINT, 129 SIGHUP). Raises on errors."""
    import torch.distributed as dist

    cfg = resolve(
        path, overrides, world_size=env.world_size, local_world_size=env.local_world_size
    ).config
    probe = start_probe(cfg, env)  # before the process group: the flight recorder's variables
    obs = Observer(cfg, env)  # before the model exists: CPU tensor memory for the profiler
    try:
        summary = run(build_session(cfg, env), obs=obs, stop=stop, probe=probe)
    except BaseException as exc:
        probe.failed(exc)  # a collective timeout: the launcher reports before this rank exits
        raise
    finally:
        probe.close()
    if env.rank == 0:
        print_summary(summary, cfg=cfg)
        note = summary.stop_note or f"all {summary.steps} steps done."
        report_outcome(signum=summary.stop_signal, note=note)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 128 + summary.stop_signal if summary.stop_signal else 0


def start_probe(cfg: RunConfig, env: DistEnv) -> HangProbe:
    """Hang triage for this rank ([Note: hang triage, worker side]), with torch's flight
    recorder turned on unless the user set its variables ([Note: flight recorder])."""

    run_dir = Path(cfg.logging.run_dir)
    set_env_defaults(prepare(hang_dir=run_dir / HANG_DIR, device_type=env.device_type))
    return HangProbe.start(
        rank=env.rank,
        run_dir=run_dir,
        control=env.control_dir,
        timeout_s=cfg.parallel.timeout_s,
        hang_timeout_s=cfg.parallel.hang_timeout_s,
    )


def _say_second_signal(rank: int) -> Callable[[int], None]:
    def note(signum: int) -> None:
        if rank == 0:
            name = signal.Signals(signum).name
            text = f"fsdpkit train: second {name}: stopping at once without saving.\n"
            with contextlib.suppress(OSError):
                os.write(2, text.encode())

    return note


def main(path: str | None, overrides: Sequence[str], env: DistEnv) -> NoReturn:
    """Run ``train_worker`` and exit the process with its code (2 for a user error,
    1 for anything else, after recording the error for the launcher)."""
    stop = install_stop_flag()
    stop.on_second = _say_second_signal(env.rank)
    # The built-in loss never modifies logits in place, which is what this warns about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    try:
        code = train_worker(path, overrides, env, stop=stop)
    except UserError as exc:
        write_error(exc, rank=env.rank, user=True)
        code = 2
    except BaseException as exc:
        write_error(exc, rank=env.rank, user=False)
        code = 1
    with contextlib.suppress(OSError):  # a hung-up terminal
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
