"""A short all-reduce benchmark over the doctor's rendezvous: every node starts its
local ranks, they form one process group (NCCL on GPUs, gloo on CPUs) through the
rendezvous store, and all-reduce a few sizes. Reported as nccl-tests does: algorithm
bandwidth = bytes / time, bus bandwidth = algbw x 2(n-1)/n (what each link carries).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

from fsdpkit import netinfo
from fsdpkit.doctor.check import Check, fail, ok, warn
from fsdpkit.doctor.network import PREFIX, Rendezvous
from fsdpkit.runtime.launch import scoped_environ

MiB = 1024**2
CPU_SIZES = (1 * MiB, 16 * MiB)
GPU_SIZES = (64 * MiB, 512 * MiB)


@dataclass(frozen=True)
class Measurement:
    nbytes: int
    seconds: float
    """Mean time of one all-reduce on the slowest rank."""
    world: int

    @property
    def algbw(self) -> float:
        return self.nbytes / self.seconds

    @property
    def busbw(self) -> float:
        return self.algbw * 2 * (self.world - 1) / self.world if self.world > 1 else self.algbw


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(*, device: Any, sizes: tuple[int, ...], iters: int) -> list[Measurement]:
    """All-reduce each size ``iters`` times on the initialized default group."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    out = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(2):
            dist.all_reduce(t)
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        _sync(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        out.append(Measurement(nbytes, float(elapsed.item()), world))
    return out


def bench_rank(
    endpoint: tuple[str, int], *, rank: int, local_rank: int, world: int, timeout_s: float
) -> None:
    """One benchmark rank: join the group through the rendezvous store, measure, and
    (global rank 0) store the measurements."""
    import json

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(
        f"{PREFIX}pg", dist.TCPStore(endpoint[0], endpoint[1], None, False, timeout)
    )
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device if cuda else None,
    )
    try:
        sizes, iters = (GPU_SIZES, 20) if cuda else (CPU_SIZES, 5)
        results = measure(device=device, sizes=sizes, iters=iters)
        if rank == 0:
            record = {"backend": dist.get_backend(), "results": [r.__dict__ for r in results]}
            store.set("result", json.dumps(record))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _worker(
    endpoint: tuple[str, int], rank: int, local_rank: int, world: int, timeout_s: float, errors: Any
) -> None:
    """A spawned benchmark rank; reports its error through ``errors``."""
    code = 0
    try:
        bench_rank(endpoint, rank=rank, local_rank=local_rank, world=world, timeout_s=timeout_s)
    except BaseException as exc:
        code = 1
        errors.put((rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo can abort during interpreter shutdown otherwise


def _worker_env(rdzv: Rendezvous) -> dict[str, str]:
    """The ranks' sockets on the interface a training run would use
    (``netinfo.collective_interface``: loopback for a loopback endpoint)."""
    peer = None if rdzv.endpoint.loopback else rdzv.endpoint.host
    return netinfo.socket_ifname_env(netinfo.collective_interface(peer=peer), current=os.environ)


def run_workers(rdzv: Rendezvous, *, nproc: int, timeout_s: float) -> list[tuple[int, str, str]]:
    """Run this node's ranks and wait; the errors they reported, as (rank, message,
    traceback). Local rank 0 runs in this process (torch is imported already), the
    others are spawned."""
    endpoint = (rdzv.endpoint.host, rdzv.endpoint.port)
    world = rdzv.nnodes * nproc
    first = rdzv.node_rank * nproc
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    with scoped_environ(_worker_env(rdzv)):
        procs = [
            ctx.Process(
                target=_worker,
                args=(endpoint, first + i, i, world, timeout_s, errors),
                daemon=True,
            )
            for i in range(1, nproc)
        ]
        for p in procs:
            p.start()
        try:
            bench_rank(endpoint, rank=first, local_rank=0, world=world, timeout_s=timeout_s)
            inline = []
        except Exception as exc:
            inline = [(first, f"{type(exc).__name__}: {exc}", traceback.format_exc())]
    return inline + _wait(procs, errors, first_rank=first + 1, timeout_s=timeout_s)


def _wait(
    procs: list[Any], errors: Any, *, first_rank: int, timeout_s: float
) -> list[tuple[int, str, str]]:
    if not procs:
        return []
    deadline = time.monotonic() + timeout_s + 30
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    out = []
    while True:
        try:
            out.append(errors.get(timeout=0.2))
        except queue.Empty:
            break
    for i, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join(5)
            out.append((first_rank + i, f"still running after {timeout_s + 30:.0f} s", ""))
        elif p.exitcode and not out:
            out.append((first_rank + i, f"the rank process exited with code {p.exitcode}", ""))
    return out


def _fmt(m: Measurement) -> str:
    return (
        f"{m.nbytes // MiB} MiB: {m.seconds * 1e3:.2f} ms, algbw {m.algbw / 1e9:.2f} GB/s, "
        f"busbw {m.busbw / 1e9:.2f} GB/s"
    )


def check_bandwidth(record: dict[str, Any], *, nnodes: int, nproc: int) -> Check:
    """The verdict on a benchmark record ({"backend", "results"})."""
    results = [Measurement(**r) for r in record["results"]]
    backend = record["backend"]
    text = f"all-reduce over {nnodes} node(s) x {nproc} rank(s) ({backend}): " + "; ".join(
        _fmt(m) for m in results
    )
    best = max(m.busbw for m in results)
    if backend == "nccl" and nnodes > 1 and best < 3e9:
        return warn(
            "all-reduce",
            f"{text}: slower than any RDMA network, NCCL probably fell back to TCP sockets",
            "NCCL_DEBUG=INFO shows the transport; check NCCL_IB_DISABLE, NCCL_IB_HCA and "
            "NCCL_SOCKET_IFNAME",
        )
    return ok("all-reduce", text)


def benchmark(rdzv: Rendezvous, *, nproc: int, timeout_s: float) -> Check:
    """Run this node's ranks and read the shared result from the store."""
    import json

    errors = run_workers(rdzv, nproc=nproc, timeout_s=timeout_s)
    if errors:
        rank, message, _ = sorted(errors)[0]
        return fail(
            "all-reduce",
            f"the collective benchmark failed on rank {rank}: {message}. The nodes reach the "
            "rendezvous store but their ranks could not connect to or finish with each other",
            "set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface on the network the "
            "nodes share, and open the ports between nodes (ranks listen on random ports)",
        )
    try:
        rdzv.store.wait([f"{PREFIX}pg/result"], datetime.timedelta(seconds=timeout_s))
        record = json.loads(rdzv.store.get(f"{PREFIX}pg/result"))
    except Exception as exc:
        return fail("all-reduce", f"no benchmark result arrived: {type(exc).__name__}: {exc}")
    return check_bandwidth(record, nnodes=rdzv.nnodes, nproc=nproc)
