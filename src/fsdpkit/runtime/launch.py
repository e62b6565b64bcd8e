"""Starting ranks with torch's own distributed runtime, and reporting how they ended.

Two ways in:
- spawn: ``fsdpkit train --nproc N`` starts N local workers through
  ``torch.distributed.launcher`` (the elastic agent torchrun uses); each worker runs
  ``python -m fsdpkit train ...`` again and joins.
- join: under torchrun (RANK/WORLD_SIZE set) or SLURM (SLURM_PROCID/SLURM_NTASKS, see
  fsdpkit.runtime.slurm) the process is a worker (fsdpkit.runtime.distenv).

Workers write their error, if any, to ``$FSDPKIT_ERROR_DIR/rank-N-attempt-A.json`` and
rank 0 how the run ended (``outcome.json``); the spawning launcher prints what happened
once ([Note: root cause] in fsdpkit.runtime.failures, [Note: stopping a spawned run] in
fsdpkit.runtime.interrupts). Workers die with their launcher ([Note: worker lifetime] in
fsdpkit.runtime.lifetime); every listener binds to loopback on one node ([Note:
listeners] in fsdpkit.runtime.rendezvous).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpkit import netinfo
from fsdpkit.runtime import failures
from fsdpkit.runtime.controldir import control_dir
from fsdpkit.runtime.distenv import (
    ERROR_DIR_VAR,
    LAUNCHER_PID_VAR,
    LOCKED_VAR,
    OUTCOME_FILE,
)
from fsdpkit.runtime.hangs import HangWatch
from fsdpkit.runtime.interrupts import ImmediateStop, LauncherSignals
from fsdpkit.runtime.rendezvous import NodeLostError, register
from fsdpkit.runtime.signals import describe_stop

if TYPE_CHECKING:
    from fsdpkit.runtime.hangs import HangWatch


@dataclass(frozen=True)
class SpawnOptions:
    nproc: int
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    run_id: str | None = None
    run_dir: Path | None = None
    """The run's logging.run_dir, for messages naming the newest checkpoint."""
    local_addr: str | None = None
    """This node's address for other nodes (multi-node); default: the one on the route
    to the rendezvous endpoint."""
    lock_held: bool = False
    """The launcher holds the run-dir lock (workers must not take it)."""
    timeout_s: float = 600.0
    """parallel.timeout_s, for the hang watch ([Note: hang triage, launcher side])."""
    hang_timeout_s: float = 0.0
    """parallel.hang_timeout_s resolved (fsdpkit.runtime.hangs.hang_timeout); 0: no stall watch."""


def _default_run_id(opts: SpawnOptions) -> str:
    """Every node of one job must present the same id; a single node gets a fresh one."""
    if opts.nnodes > 1:
        return f"fsdpkit-{opts.rdzv_endpoint}"
    return f"fsdpkit-{uuid.uuid4().hex[:8]}"


def _launch_config(opts: SpawnOptions) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    endpoint = opts.rdzv_endpoint or "127.0.0.1:0"
    local = opts.local_addr
    if local is None:
        host = endpoint.rsplit(":", 1)[0].strip("[]")
        local = "127.0.0.1" if opts.nnodes == 1 else netinfo.local_address_for(host)
    return LaunchConfig(
        min_nodes=opts.nnodes,
        max_nodes=opts.nnodes,
        nproc_per_node=opts.nproc,
        run_id=opts.run_id or _default_run_id(opts),
        rdzv_backend=register(),
        rdzv_endpoint=endpoint,
        rdzv_configs=_rdzv_configs(opts),
        max_restarts=opts.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        local_addr=local,
        # fsdpkit.runtime.interrupts handles them ([Note: stopping a spawned run])
        signals_to_handle="",
    )


def _rdzv_configs(opts: SpawnOptions) -> dict[str, Any]:
    """The static rendezvous's node rank, or the joined store's timeout ([Note: lost
    rendezvous] in fsdpkit.runtime.rendezvous)."""
    if opts.node_rank is not None:
        return {"rank": opts.node_rank}
    return {"store_timeout": int(max(opts.timeout_s, 1))} if opts.nnodes > 1 else {}


def _worker_env(opts: SpawnOptions, control: str, local_addr: str) -> dict[str, str]:
    """What the launcher tells its workers through the environment."""
    env = {ERROR_DIR_VAR: control, LAUNCHER_PID_VAR: str(os.getpid())}
    if opts.lock_held:
        env[LOCKED_VAR] = "1"
    iface = netinfo.interface_of(local_addr) if local_addr else None
    env.update(netinfo.socket_ifname_env(iface, current=os.environ))  # [Note: listeners]
    return env


@contextlib.contextmanager
def scoped_environ(changes: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``changes`` (the workers inherit it), restored after."""
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _quiet_elastic_loggers() -> None:
    """The agent's loggers set their own levels (torch's LOGLEVEL); fsdpkit prints
    what happened itself."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed")]
    for name in ["torch.distributed.elastic", *names]:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def spawn(argv: list[str], opts: SpawnOptions) -> int:
    """Run ``python -m fsdpkit train *argv`` on ``opts.nproc`` local workers; the exit
    code is 0, 2 for a user error on any rank, 128 + N after signal N, 1 otherwise."""
    _quiet_elastic_loggers()
    os.environ.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // opts.nproc, 1)))
    config = _launch_config(opts)
    with (
        control_dir() as control,
        scoped_environ(_worker_env(opts, str(control), config.local_addr)),
    ):
        return _launch(config, argv, control=control, opts=opts)


def _launch(config: Any, argv: list[str], *, control: Path, opts: SpawnOptions) -> int:
    """The elastic launch under the launcher's signal handling; how it ended, said once."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    oom_before = failures.OomCounters.read()
    with LauncherSignals() as signals, _hang_watch(control, opts) as watch:
        try:
            elastic_launch(config, sys.executable)("-m", "fsdpkit", "train", *argv)
        except ChildFailedError as exc:
            signals.settled = True
            hang = watch.post_mortem()  # the watch stopped a hung run, or NCCL dumped one
            if hang is not None:
                _say(f"error: {hang.message} {failures.newest_checkpoint_note(opts.run_dir)}")
                return 1
            return _report_failure(control, exc, oom_before=oom_before, opts=opts)
        except SignalException as exc:
            signals.settled = True
            if watch.report is not None:  # a hung run cannot stop at a step boundary
                _say(f"error: {watch.report.message}")
            return _report_stop(control, int(exc.sigval), opts=opts)
        except ImmediateStop as exc:
            signals.settled = True
            return _report_immediate(exc.signum, opts=opts)
        except NodeLostError as exc:  # [Note: lost rendezvous]
            signals.settled = True
            _say(f"error: {exc} {failures.newest_checkpoint_note(opts.run_dir)}")
            return 1
    return 0


def _hang_watch(control: Path, opts: SpawnOptions) -> HangWatch:

    return HangWatch(
        control=control,
        run_dir=opts.run_dir or Path("."),
        nproc=opts.nproc,
        stall_s=opts.hang_timeout_s,
        timeout_s=opts.timeout_s,
        several_nodes=opts.nnodes > 1,
    )


def _say(text: str) -> None:
    with contextlib.suppress(OSError):  # the terminal hung up
        print(f"fsdpkit train: {text}", file=sys.stderr, flush=True)


def _report_stop(control: Path, signum: int, *, opts: SpawnOptions) -> int:

    what = describe_stop(signum)
    try:
        record = json.loads((control / OUTCOME_FILE).read_text())
        note, stopped = str(record["note"]), int(record["signal"])
    except (OSError, ValueError, KeyError):
        note, stopped = "", -1
    if stopped == 0:  # the signal came as the last step finished
        _say(f"{what} arrived as the run ended: {note}")
        return 0
    if stopped < 0:
        note = (
            f"{what}: the workers ended before they could save (a save waits for the "
            "current step to finish; they are killed after TORCH_ELASTIC_SHUTDOWN_TIMEOUT, "
            f"30 s by default). {failures.newest_checkpoint_note(opts.run_dir)}"
        )
    _say(note)
    return 128 + signum


def _report_immediate(signum: int, *, opts: SpawnOptions) -> int:
    name = signal.Signals(signum).name
    how = "SIGQUIT" if signum == signal.SIGQUIT else f"a second {name}"
    _say(
        f"{how}: stopped at once without saving (the workers were killed; an unfinished "
        f"save is left as an ignored .tmp directory). "
        f"{failures.newest_checkpoint_note(opts.run_dir)}"
    )
    return 128 + signum


def _report_failure(
    control: Path, exc: Any, *, oom_before: failures.OomCounters, opts: SpawnOptions
) -> int:
    stop = control / OUTCOME_FILE
    stopped = int(json.loads(stop.read_text())["signal"]) if stop.is_file() else 0
    if stopped:  # a stop signal sent to the workers themselves
        return _report_stop(control, stopped, opts=opts)
    cause = failures.root_cause(control)
    if cause is not None and not failures.is_secondary(str(cause["message"])):
        _say(f"error on rank {cause['rank']}: {cause['message']}")
        return 2 if cause["user"] else 1
    deaths = failures.signal_deaths(getattr(exc, "failures", {}))
    if deaths:
        oom = failures.OomCounters.read().rose_since(oom_before)
        death = failures.describe_signal_death(deaths[0], oom=oom)
        _say(f"error: {death} {failures.newest_checkpoint_note(opts.run_dir)}")
        return 1
    if cause is not None and opts.nnodes > 1:  # [Note: lost node]
        local = sorted(int(r) for r in getattr(exc, "failures", {}))
        lost = failures.describe_lost_node(
            str(cause["message"]), local_ranks=local, world_size=opts.nproc * opts.nnodes
        )
        _say(f"error: {lost} {failures.newest_checkpoint_note(opts.run_dir)}")
        return 1
    if cause is not None:
        _say(f"error on rank {cause['rank']}: {cause['message']}")
        return 2 if cause["user"] else 1
    detail = "; ".join(
        f"rank {rank} exit code {f.exitcode}" for rank, f in getattr(exc, "failures", {}).items()
    )
    _say(f"error: a worker exited without reporting an error ({detail}).")
    return 1
