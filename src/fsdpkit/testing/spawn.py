"""Run a function on N real processes with the gloo backend, safely.

Why not torchrun or a fixed port: concurrent jobs collide on ports, and
``MASTER_PORT=0`` hangs. Each call gets a file-based rendezvous (FileStore) in its own
temporary directory, a process-group timeout, a hard timeout in the parent that kills
the whole group, per-rank traceback files (so the error shown is the failing rank's,
not a peer's "connection closed"), and ``os._exit`` at the end of each worker (gloo
can abort during interpreter shutdown; see ../shared/cpu-fsdp-facts.md).

Ranks are forked from a multiprocessing forkserver that imported torch once ([Note:
ranks from a forkserver]), not spawned: a spawned rank spends 1-2 s of CPU importing
torch before it does anything, ~4.5 s for four ranks on two cores, every call.

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
from typing import Any, Literal

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "fsdpkit.train.loop",
]
"""What the forkserver imports once: torch and fsdpkit's trainer, which nearly every
rank imports. What they read from the environment when imported (torch's compiler
settings) is the environment the server started with; transformers, which reads
HF_HUB_OFFLINE when imported, is left to each rank."""


class RankFailure(RuntimeError):
    """A rank raised, crashed or timed out; the message holds its traceback."""


def _caller_state() -> tuple[dict[str, str], str, list[str]]:
    """The caller's environment, working directory and import path, as a spawned rank
    would inherit them at this call."""
    return dict(os.environ), os.getcwd(), list(sys.path)


def _worker(
    call: bytes,
    state: tuple[dict[str, str], str, list[str]],
    rank: int,
    world_size: int,
    tmp: str,
    pg_timeout_s: float,
    threads: int,
) -> None:
    """One rank: take on the caller's state, then unpickle and run its function.

    [Note: ranks from a forkserver]
    A forkserver child starts as a copy of the server: the environment, working
    directory and ``sys.path`` the server had when the first call started it, not the
    caller's now (a test may have set HF_HUB_OFFLINE or changed directory since). So
    the rank first takes on the caller's state (``os.environ`` writes through to the C
    environment, which gloo and torch's C++ read), and only then unpickles ``fn`` and
    its arguments: unpickling imports ``fn``'s module, whose imports must see that
    state. Only torch is preloaded; what reads the environment when imported
    (transformers) is imported by the rank itself."""
    code = 0
    try:
        env, cwd, path = state
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path
        fn, args = pickle.loads(call)
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
    start_method: Literal["forkserver", "spawn"] = "forkserver",
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each
    rank's result. ``fn`` must be importable (a module-level function). Each rank sees
    the caller's environment, working directory and ``sys.path`` as of this call,
    whichever ``start_method`` starts it ([Note: ranks from a forkserver])."""
    if start_method == "spawn":
        ctx: mp.context.SpawnContext | mp.context.ForkServerContext = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call)
    call = pickle.dumps((fn, tuple(args)))
    state = _caller_state()
    pg_timeout_s = max(timeout_s - 5, 10)
    with tempfile.TemporaryDirectory(prefix="fsdpkit-ranks-") as tmp:
        procs = [
            ctx.Process(
                target=_worker,
                args=(call, state, r, world_size, tmp, pg_timeout_s, threads_per_rank),
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
