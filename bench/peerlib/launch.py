"""Start the ranks of one implementation the way torchrun would (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT in the environment), one thread per rank, with a hard
timeout; every rank's output goes to one log file."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from peerlib.common import SPEC_VAR, Spec

BENCH = Path(__file__).resolve().parent.parent


class LaunchFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(*, threads: int = 1) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def run_ranks(
    argv: list[str],
    *,
    nproc: int,
    spec: Spec | None,
    log: Path,
    timeout_s: float,
    extra_env: dict[str, str] | None = None,
) -> None:
    """Run ``python argv...`` on ``nproc`` ranks; ``nproc=0`` runs one process without
    rank variables (a launcher of its own, like ``fsdpkit train``). Raises LaunchFailed
    (with the log's tail) when any process fails or time runs out."""
    port = free_port()
    procs = []
    with log.open("w") as out:
        for rank in range(max(nproc, 1)):
            env = {**base_env(), **(extra_env or {})}
            if nproc:
                env.update(_rank_env(rank, nproc, port))
            if spec is not None:
                env[SPEC_VAR] = json.dumps(asdict(spec))
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        codes = _wait(procs, timeout_s=timeout_s)
    if any(codes):
        tail = log.read_text()[-3000:]
        raise LaunchFailed(f"{' '.join(argv)}: exit codes {codes}\n{tail}")


def _wait(procs: list[subprocess.Popen[bytes]], *, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes if c is not None]
        if any(c not in (None, 0) for c in codes):
            time.sleep(2)  # let the others report their own error, then stop them
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return [p.wait() if p.returncode is None else p.returncode for p in procs]
