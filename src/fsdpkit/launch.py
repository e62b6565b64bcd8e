"""Starting ranks with torch's own distributed runtime, and reporting how they ended.

Two ways in:
- spawn: ``fsdpkit train --nproc N`` starts N local workers through
  ``torch.distributed.launcher`` (the elastic agent torchrun uses); each worker runs
  ``python -m fsdpkit train ...`` again and joins.
- join: under torchrun (RANK/WORLD_SIZE set) or SLURM (SLURM_PROCID/SLURM_NTASKS, see
  fsdpkit.slurm) the process is a worker.

This is the only module that reads the environment. Workers write their error, if
any, to ``$FSDPKIT_ERROR_DIR/rank-N-attempt-A.json`` and rank 0 how the run ended
(``outcome.json``); the spawning launcher prints what happened once
([Note: root cause] in fsdpkit.failures, [Note: stopping a spawned run] in
fsdpkit.interrupts). Workers die with their launcher ([Note: worker lifetime] in
fsdpkit.lifetime); every listener binds to loopback on one node ([Note: listeners]
in fsdpkit.rendezvous).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpkit import failures, netinfo, slurm
from fsdpkit.devices import device_type, local_gpus

if TYPE_CHECKING:
    from fsdpkit.hangs import HangWatch

ERROR_DIR_VAR = "FSDPKIT_ERROR_DIR"
LAUNCHER_PID_VAR = "FSDPKIT_LAUNCHER_PID"
"""Set by the spawning launcher: the pid workers bind their lifetime to."""
LOCKED_VAR = "FSDPKIT_RUN_DIR_LOCKED"
"""Set by a launcher that holds the run-dir lock itself (rank 0 then does not take it)."""
OUTCOME_FILE = "outcome.json"


@dataclass(frozen=True)
class DistEnv:
    """Who this worker is; read once from the environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device_type: str
    launcher_pid: int | None = None
    """The fsdpkit launcher that spawned this worker (None: torchrun, SLURM, a test)."""
    run_dir_locked: bool = False
    """Whether that launcher already holds the run-dir lock ([Note: run-dir lock])."""
    control_dir: Path | None = None
    """The spawning launcher's control directory (errors, hang triage); None when joined."""

    @property
    def single_node(self) -> bool:
        return self.local_world_size == self.world_size


def joined_env() -> DistEnv | None:
    """The worker's identity when launched by torchrun/SLURM/our launcher, else None."""
    env = os.environ
    env.update(slurm.torch_env(env))
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    launcher = env.get(LAUNCHER_PID_VAR)
    return DistEnv(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
        device_type=device_type(),
        launcher_pid=int(launcher) if launcher else None,
        run_dir_locked=env.get(LOCKED_VAR) == "1",
        control_dir=_control_dir(),
    )


def set_env_defaults(values: dict[str, str]) -> None:
    """Set variables the user has not set (their own choice wins), e.g. the flight
    recorder's before the process group exists ([Note: flight recorder])."""
    for key, value in values.items():
        os.environ.setdefault(key, value)


def bind_worker_lifetime(env: DistEnv) -> None:
    """Make this worker die with the process that started it ([Note: worker
    lifetime]): our launcher, or torchrun's agent. SLURM tasks are left to slurmstepd."""
    from fsdpkit.lifetime import bind_to_parent

    if env.launcher_pid is not None:
        bind_to_parent(env.launcher_pid)
    elif "TORCHELASTIC_RUN_ID" in os.environ and os.getppid() != 1:
        bind_to_parent(os.getppid())


def pin_collectives(env: DistEnv) -> None:
    """Point gloo's and NCCL's sockets at one interface unless the user chose
    ([Note: listeners]): loopback on one node, else the interface of the address the
    other nodes reach this one at."""
    if env.single_node:
        name = netinfo.loopback_interface()
    else:
        master = os.environ.get("MASTER_ADDR")
        name = netinfo.interface_of(netinfo.local_address_for(master)) if master else None
    if name:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def rendezvous_store(env: DistEnv, *, timeout: datetime.timedelta) -> Any:
    """The c10d store for ``init_process_group``, namespaced by restart attempt.

    Under an elastic agent (ours or torchrun's) the agent hosts the store and every
    rank is a client. Otherwise (SLURM, a hand-set environment) rank 0 hosts it: on
    loopback when all ranks share this node, else on MASTER_ADDR's address only
    ([Note: listeners]).

    [Note: restart attempts]
    After the elastic agent restarts workers (``--max-restarts``), the store it serves
    still holds the previous attempt's peer addresses; gloo would dial dead ports
    ("Connection refused"). Prefixing every key with the attempt number gives each
    attempt a clean namespace on the same store.
    """
    from torch.distributed import PrefixStore

    from fsdpkit.rendezvous import ANSWER_S, connect_store, serve_store

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if not agent and env.single_node:
        host = "127.0.0.1"
    if not agent and env.rank == 0:
        try:
            store = serve_store(host, port, timeout=timeout)
        except OSError as exc:
            from fsdpkit.rendezvous import RendezvousError

            raise RendezvousError(
                f"rank 0 cannot listen on {host}:{port} (MASTER_ADDR:MASTER_PORT): "
                f"{exc.strerror or exc}; held by {netinfo.port_holder(port) or 'unknown'}. "
                "Export another MASTER_PORT (under SLURM it defaults to 10000 + job id "
                "mod 10000)."
            ) from None
    else:
        store = connect_store(host, port, timeout=timeout, answer_s=None if agent else ANSWER_S)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"fsdpkit/attempt-{attempt}", store)


def default_nproc() -> int:
    """Number of GPUs, or 2 CPU ranks on a machine without GPUs."""
    return local_gpus() or 2


def _control_dir() -> Path | None:
    directory = os.environ.get(ERROR_DIR_VAR)
    return Path(directory) if directory else None


def write_error(exc: BaseException, *, rank: int, user: bool) -> None:
    """Record this rank's failure for the launcher (or print it when joined)."""
    message = str(exc) if user else _describe_crash(exc)
    directory = _control_dir()
    if directory:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        record = {
            "rank": rank,
            "attempt": attempt,
            "time": time.time(),
            "user": user,
            "message": message,
        }
        (directory / f"rank-{rank}-attempt-{attempt}.json").write_text(json.dumps(record))
    elif rank == 0 or not user:
        print(f"fsdpkit train: rank {rank}: error: {message}", file=sys.stderr, flush=True)


def report_outcome(*, signum: int | None, note: str) -> None:
    """Rank 0, at the end: tell the launcher how the run ended (``signum``: the stop
    signal, None: all steps done) and what was saved (``note``); printed when joined."""
    directory = _control_dir()
    if directory:
        (directory / OUTCOME_FILE).write_text(json.dumps({"signal": signum or 0, "note": note}))
    elif signum:
        print(f"fsdpkit train: {note}", file=sys.stderr, flush=True)


def _describe_crash(exc: BaseException) -> str:
    """The error in one line, then the traceback of its innermost cause."""
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    trace = "".join(traceback.format_exception(cause)).rstrip()
    return f"{exc}\n\n{trace}"


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
    """parallel.hang_timeout_s resolved (fsdpkit.hangs.hang_timeout); 0: no stall watch."""


def _default_run_id(opts: SpawnOptions) -> str:
    """Every node of one job must present the same id; a single node gets a fresh one."""
    if opts.nnodes > 1:
        return f"fsdpkit-{opts.rdzv_endpoint}"
    return f"fsdpkit-{uuid.uuid4().hex[:8]}"


def _launch_config(opts: SpawnOptions) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    from fsdpkit.rendezvous import register

    endpoint = opts.rdzv_endpoint or "127.0.0.1:0"
    local = opts.local_addr
    if local is None:
        host = endpoint.rsplit(":", 1)[0].strip("[]")
        local = "127.0.0.1" if opts.nnodes == 1 else netinfo.local_address_for(host)
    static = opts.node_rank is not None
    return LaunchConfig(
        min_nodes=opts.nnodes,
        max_nodes=opts.nnodes,
        nproc_per_node=opts.nproc,
        run_id=opts.run_id or _default_run_id(opts),
        rdzv_backend=register(),
        rdzv_endpoint=endpoint,
        rdzv_configs={"rank": opts.node_rank} if static else {},
        max_restarts=opts.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        local_addr=local,
        signals_to_handle="",  # fsdpkit.interrupts handles them ([Note: stopping a spawned run])
    )


def _worker_env(opts: SpawnOptions, control: str, local_addr: str) -> dict[str, str]:
    """What the launcher tells its workers through the environment."""
    env = {ERROR_DIR_VAR: control, LAUNCHER_PID_VAR: str(os.getpid())}
    if opts.lock_held:
        env[LOCKED_VAR] = "1"
    iface = netinfo.interface_of(local_addr) if local_addr else None
    if iface:  # [Note: listeners]; a user's own choice wins
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env[key] = os.environ.get(key, iface)
    return env


@contextlib.contextmanager
def _environ(changes: dict[str, str]) -> Iterator[None]:
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
        tempfile.TemporaryDirectory(prefix="fsdpkit-control-") as control,
        _environ(_worker_env(opts, control, config.local_addr)),
    ):
        return _launch(config, argv, control=Path(control), opts=opts)


def _launch(config: Any, argv: list[str], *, control: Path, opts: SpawnOptions) -> int:
    """The elastic launch under the launcher's signal handling; how it ended, said once."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from fsdpkit.interrupts import ImmediateStop, LauncherSignals

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
    return 0


def _hang_watch(control: Path, opts: SpawnOptions) -> HangWatch:
    from fsdpkit.hangs import HangWatch

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
    from fsdpkit.checkpoint.signals import describe_stop

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
    if cause is not None:
        _say(f"error on rank {cause['rank']}: {cause['message']}")
        return 2 if cause["user"] else 1
    detail = "; ".join(
        f"rank {rank} exit code {f.exitcode}" for rank, f in getattr(exc, "failures", {}).items()
    )
    _say(f"error: a worker exited without reporting an error ({detail}).")
    return 1
