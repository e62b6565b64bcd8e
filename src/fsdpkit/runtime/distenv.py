"""A worker's side of the launch: its distributed environment (read once, from the
variables torchrun, SLURM or fsdpkit's launcher set), the process group's store and
sockets, and how it reports an error or the run's outcome back to the launcher.

With fsdpkit.runtime.launch, the only modules that read the launcher's environment.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpkit import netinfo
from fsdpkit.devices import device_type, local_gpus
from fsdpkit.runtime import slurm
from fsdpkit.runtime.lifetime import bind_to_parent

if TYPE_CHECKING:
    pass


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

    if env.launcher_pid is not None:
        bind_to_parent(env.launcher_pid)
    elif "TORCHELASTIC_RUN_ID" in os.environ and os.getppid() != 1:
        bind_to_parent(os.getppid())


def pin_collectives(env: DistEnv) -> None:
    """Point gloo's and NCCL's sockets at one interface unless the user chose
    ([Note: listeners]): loopback on one node, else the interface of the address the
    other nodes reach this one at (``netinfo.collective_interface``)."""
    peer = None if env.single_node else os.environ.get("MASTER_ADDR")
    if peer is None and not env.single_node:
        return
    os.environ.update(
        netinfo.socket_ifname_env(netinfo.collective_interface(peer=peer), current=os.environ)
    )


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
    attempt a clean namespace on the same store: under fsdpkit's launcher the
    rendezvous round, which every node agrees on (a node that came back has a restart
    count of 0, [Note: rejoined node] in fsdpkit.runtime.rendezvous).
    """
    from torch.distributed import PrefixStore

    # here, not at the top: the launcher reads this module before any config error
    # is answered, and the rendezvous brings torch.distributed (~1.5 s)
    from fsdpkit.runtime.rendezvous import (
        ANSWER_S,
        ROUND_VAR,
        RendezvousError,
        connect_store,
        serve_store,
    )

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if not agent and env.single_node:
        host = "127.0.0.1"
    if not agent and env.rank == 0:
        try:
            store = serve_store(host, port, timeout=timeout)
        except OSError as exc:
            raise RendezvousError(
                f"rank 0 cannot listen on {host}:{port} (MASTER_ADDR:MASTER_PORT): "
                f"{exc.strerror or exc}; held by {netinfo.port_holder(port) or 'unknown'}. "
                "Export another MASTER_PORT (under SLURM it defaults to 10000 + job id "
                "mod 10000)."
            ) from None
    else:
        store = connect_store(host, port, timeout=timeout, answer_s=None if agent else ANSWER_S)
    attempt = os.environ.get(ROUND_VAR) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
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
        lost = None if user else slurm.lost_node(str(exc), os.environ)  # [Note: lost node]
        print(f"fsdpkit train: rank {rank}: error: {lost or message}", file=sys.stderr, flush=True)


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
