"""Starting ranks with torch's own distributed runtime, and reporting their failures.

Two ways in:
- spawn: ``fsdpkit train --nproc N`` starts N local workers through
  ``torch.distributed.launcher`` (the elastic agent torchrun uses); each worker runs
  ``python -m fsdpkit train ...`` again and joins.
- join: under torchrun (RANK/WORLD_SIZE set) or SLURM (SLURM_PROCID/SLURM_NTASKS,
  with MASTER_ADDR/MASTER_PORT exported by the batch script) the process is a worker.

This is the only module that reads the environment. Workers write their error, if
any, to ``$FSDPKIT_ERROR_DIR/rank-N.json``; the spawning launcher prints the root
cause once (the first rank that failed for a reason other than a lost peer).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpkit.devices import device_type, local_gpus

ERROR_DIR_VAR = "FSDPKIT_ERROR_DIR"
# Messages of ranks that failed only because another rank went away first.
_SECONDARY = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "sigterm",
    "terminated",
    "socket",
    "gloo",
    "nccl",
)


@dataclass(frozen=True)
class DistEnv:
    """Who this worker is; read once from the environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device_type: str


def _slurm_to_torch_env() -> None:
    """Map SLURM's variables onto torch's env:// names (MASTER_* must be exported)."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    # SLURM_TASKS_PER_NODE is always set ("8(x2)" = 8 on each of 2 nodes).
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
    env["LOCAL_WORLD_SIZE"] = per_node.split("(")[0].split(",")[0]


def joined_env() -> DistEnv | None:
    """The worker's identity when launched by torchrun/SLURM/our launcher, else None."""
    _slurm_to_torch_env()
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    return DistEnv(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
        device_type=device_type(),
    )


def rendezvous_store(env: DistEnv, *, timeout: datetime.timedelta) -> Any:
    """The c10d store for ``init_process_group``, namespaced by restart attempt.

    [Note: restart attempts]
    After the elastic agent restarts workers (``--max-restarts``), the store it serves
    still holds the previous attempt's peer addresses; gloo would dial dead ports
    ("Connection refused"). Prefixing every key with the attempt number gives each
    attempt a clean namespace on the same store.
    """
    from torch.distributed import PrefixStore
    from torch.distributed.rendezvous import _create_c10d_store

    store = _create_c10d_store(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        env.rank,
        env.world_size,
        timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"fsdpkit/attempt-{attempt}", store)


def default_nproc() -> int:
    """Number of GPUs, or 2 CPU ranks on a machine without GPUs."""
    return local_gpus() or 2


def write_error(exc: BaseException, *, rank: int, user: bool) -> None:
    """Record this rank's failure for the launcher (or print it when joined)."""
    message = str(exc) if user else _describe_crash(exc)
    directory = os.environ.get(ERROR_DIR_VAR)
    if directory:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        record = {
            "rank": rank,
            "attempt": attempt,
            "time": time.time(),
            "user": user,
            "message": message,
        }
        Path(directory, f"rank-{rank}-attempt-{attempt}.json").write_text(json.dumps(record))
    elif rank == 0 or not user:
        print(f"fsdpkit train: rank {rank}: error: {message}", file=sys.stderr, flush=True)


def _describe_crash(exc: BaseException) -> str:
    """The error in one line, then the traceback of its innermost cause."""
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    trace = "".join(traceback.format_exception(cause)).rstrip()
    return f"{exc}\n\n{trace}"


def root_cause(directory: Path) -> dict[str, object] | None:
    """The failure to show: of the last restart attempt, the earliest primary error,
    else the earliest of all."""
    records = []
    for path in directory.glob("rank-*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not records:
        return None
    last = max(int(r.get("attempt", 0)) for r in records)
    records = sorted(
        (r for r in records if int(r.get("attempt", 0)) == last), key=lambda r: r["time"]
    )
    primary = [r for r in records if not any(k in str(r["message"]).lower() for k in _SECONDARY)]
    return (primary or records)[0]


@dataclass(frozen=True)
class SpawnOptions:
    nproc: int
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    run_id: str | None = None


def _default_run_id(opts: SpawnOptions) -> str:
    """Every node of one job must present the same id; a single node gets a fresh one."""
    if opts.nnodes > 1:
        return f"fsdpkit-{opts.rdzv_endpoint}"
    return f"fsdpkit-{uuid.uuid4().hex[:8]}"


def spawn(argv: list[str], opts: SpawnOptions) -> int:
    """Run ``python -m fsdpkit train *argv`` on ``opts.nproc`` local workers; the exit
    code is 0, 2 for a user error on any rank, 1 for anything else."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // opts.nproc, 1)))
    static = opts.node_rank is not None
    config = LaunchConfig(
        min_nodes=opts.nnodes,
        max_nodes=opts.nnodes,
        nproc_per_node=opts.nproc,
        run_id=opts.run_id or _default_run_id(opts),
        rdzv_backend="static" if static else "c10d",
        rdzv_endpoint=opts.rdzv_endpoint or "127.0.0.1:0",
        rdzv_configs={"rank": opts.node_rank} if static else {},
        max_restarts=opts.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
    )
    with tempfile.TemporaryDirectory(prefix="fsdpkit-errors-") as errors:
        os.environ[ERROR_DIR_VAR] = errors
        try:
            elastic_launch(config, sys.executable)("-m", "fsdpkit", "train", *argv)
        except ChildFailedError as exc:
            return _report_failure(Path(errors), exc)
        except SignalException as exc:
            print(
                f"fsdpkit train: stopped by {exc.sigval.name}; workers checkpointed the "
                "current step if checkpointing is configured.",
                file=sys.stderr,
            )
            return 128 + int(exc.sigval)
        finally:
            os.environ.pop(ERROR_DIR_VAR, None)
    return 0


def _report_failure(errors: Path, exc: Exception) -> int:
    cause = root_cause(errors)
    if cause is None:
        failures = getattr(exc, "failures", {})
        detail = "; ".join(
            f"rank {f.rank} exit code {f.exitcode}"
            + (f" ({f.signal_name()})" if f.exitcode < 0 else "")
            for f in failures.values()
        )
        print(
            f"fsdpkit train: error: a worker died without reporting an error ({detail}). "
            "A negative code is a signal: SIGKILL often means the machine ran out of memory "
            "(try `fsdpkit plan` for a config that fits).",
            file=sys.stderr,
        )
        return 1
    print(f"fsdpkit train: error on rank {cause['rank']}: {cause['message']}", file=sys.stderr)
    return 2 if cause["user"] else 1
