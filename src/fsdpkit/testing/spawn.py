"""Run a function on N real processes with the gloo backend, safely.

Why not torchrun or a fixed port: concurrent jobs collide on ports, and
``MASTER_PORT=0`` hangs. Each call gets a file-based rendezvous (FileStore) in its own
temporary directory, a process-group timeout, a hard timeout in the parent that kills
the whole group, per-rank traceback files (so the error shown is the failing rank's,
not a peer's "connection closed"), and ``os._exit`` at the end of each worker (gloo
can abort during interpreter shutdown; see ../shared/cpu-fsdp-facts.md).

    def work(rank: int, world_size: int, x: int) -> float: ...
    results = run_ranks(work, world_size=2, args=(3,))   # [result of rank 0, rank 1]
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class RankFailure(RuntimeError):
    """A rank raised, crashed or timed out; the message holds its traceback."""


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: Sequence[Any],
    tmp: str,
    pg_timeout_s: float,
    threads: int,
) -> None:
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        os.environ.update(LOCAL_WORLD_SIZE=str(world_size))
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args)
        with open(f"{tmp}/result-{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        code = 1
        Path(f"{tmp}/error-{rank}.txt").write_text(traceback.format_exc())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _first_error(tmp: str) -> tuple[int, str] | None:
    errors = sorted(Path(tmp).glob("error-*.txt"), key=lambda p: p.stat().st_mtime)
    if not errors:
        return None
    return int(errors[0].stem.split("-")[1]), errors[0].read_text()


def run_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 180.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each
    rank's result. ``fn`` must be importable (a module-level function)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fsdpkit-ranks-") as tmp:
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, args, tmp, max(timeout_s - 5, 10), threads_per_rank),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        _wait(procs, tmp=tmp, timeout_s=timeout_s)
        results = []
        for r in range(world_size):
            with open(f"{tmp}/result-{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


def _wait(procs: list[Any], *, tmp: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > 5):
            break
        time.sleep(0.05)
    alive = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    error = _first_error(tmp)
    if error is not None:
        rank, text = error
        raise RankFailure(f"rank {rank} failed:\n{text}")
    if alive:
        raise RankFailure(f"timed out after {timeout_s:.0f}s; ranks {alive} were still running")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RankFailure(f"ranks exited abnormally without a traceback: {bad}")
