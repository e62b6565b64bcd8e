"""Checkpoint I/O against the disk's raw speed, and async vs sync blocking time.

    .venv/bin/python bench/checkpoint_io.py [--layers 6] [--dim 768] [--reps 3] [--dir /tmp]

A Llama (~62M params by default) with AdamW state (~750 MB in fp32) is sharded over 2
CPU ranks. In the same run and directory each rank also writes and reads the same
number of bytes with plain sequential I/O (write + fsync; read after evicting the file
from the page cache with posix_fadvise), so "vs raw" compares like with like. Every
timing is wall time between two barriers (both ranks done), median of --reps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fsdpkit import RunConfig, build_mesh, shard
from fsdpkit.checkpoint import Checkpointer, ModelOptimizerState
from fsdpkit.config import CheckpointConfig
from fsdpkit.models.llama import Llama, preset
from fsdpkit.testing import run_ranks

_CHUNK = 8 << 20


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _evict(paths: list[Path]) -> None:
    """Drop these files from the page cache so the next read hits the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        view = memoryview(data)
        for i in range(0, len(view), _CHUNK):
            f.write(view[i : i + _CHUNK])
        f.flush()
        os.fsync(f.fileno())


def _raw_read(path: Path) -> None:
    buf = bytearray(_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def _my_files(ckpt: Path, rank: int) -> list[Path]:
    return [p for p in ckpt.iterdir() if p.name.startswith(f"__{rank}_") or rank == 0]


def _build(layers: int, dim: int) -> tuple[dict[str, Any], Llama]:
    cfg = preset("tiny", n_layers=layers, dim=dim, n_heads=12, n_kv_heads=4, ffn_dim=2048)
    cfg = preset("tiny", **{**cfg.to_dict(), "vocab_size": 32000})
    with torch.device("meta"):
        model = Llama(cfg)
    shard(model, RunConfig(), mesh=build_mesh(device_type="cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.zeros(1, 16, dtype=torch.long)).float().pow(2).mean().backward()
    opt.step()  # materialize AdamW state
    opt.zero_grad(set_to_none=True)
    return {"app": ModelOptimizerState(model, opt)}, model


def _one_rep(rep: int, state: dict[str, Any], base: Path, rank: int) -> dict[str, float]:
    out: dict[str, float] = {}
    sync = Checkpointer(run_dir=base / "sync", cfg=CheckpointConfig(keep=1), run_meta={})
    out["ckpt_save"] = _timed(lambda: sync.save(rep, state, blocking=True))
    ckpt = base / "sync" / "checkpoints" / f"step-{rep:08d}"
    mine = sum(p.stat().st_size for p in ckpt.iterdir() if p.name.startswith(f"__{rank}_"))
    raw = base / f"raw-{rank}.bin"
    data = np.random.default_rng(rep).bytes(mine)
    out["raw_write"] = _timed(lambda: _raw_write(raw, data))
    _evict([raw])
    out["raw_read"] = _timed(lambda: _raw_read(raw))
    plain = base / f"plain-{rep}"
    out["dcp_save"] = _timed(lambda: dcp.save(state, checkpoint_id=str(plain)))
    _evict(_my_files(plain, rank))
    out["dcp_load"] = _timed(lambda: dcp.load(state, checkpoint_id=str(plain)))
    _evict(_my_files(ckpt, rank))
    cfg = CheckpointConfig(resume=str(ckpt))
    loader = Checkpointer(run_dir=base / "other", cfg=cfg, run_meta={})
    out["ckpt_resume"] = _timed(lambda: loader.resume(state))
    asy = Checkpointer(
        run_dir=base / "async", cfg=CheckpointConfig(keep=1, async_save=True), run_meta={}
    )
    out["async_total"] = _timed(lambda: (asy.save(rep, state), asy.wait()))
    out["async_blocking"] = asy.last_blocking_s
    out["bytes"] = float(sum(p.stat().st_size for p in ckpt.iterdir()))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(plain, ignore_errors=True)
    raw.unlink()
    return out


def _bench(rank: int, world: int, layers: int, dim: int, reps: int, where: str) -> dict[str, Any]:
    state, model = _build(layers, dim)
    params = sum(p.numel() for p in model.parameters())
    base = Path(where)
    runs = [_one_rep(rep + 1, state, base, rank) for rep in range(reps)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"params": params}


def _table(r: dict[str, Any]) -> str:
    gb = r["bytes"] / 1e9
    rows = [
        ("raw sequential write + fsync", "raw_write", "raw_write"),
        ("dcp.save (plain)", "dcp_save", "raw_write"),
        ("Checkpointer.save sync (DCP + crc32 + commit)", "ckpt_save", "raw_write"),
        ("raw sequential read (cold cache)", "raw_read", "raw_read"),
        ("dcp.load (cold cache)", "dcp_load", "raw_read"),
        ("Checkpointer.resume (verify + load, cold)", "ckpt_resume", "raw_read"),
    ]
    lines = [
        f"model {r['params'] / 1e6:.1f}M params + AdamW, checkpoint {gb:.3f} GB, 2 CPU ranks",
        f"| {'operation':<46} | {'seconds':>7} | {'GB/s':>6} | {'vs raw':>6} |",
        f"|{'-' * 48}|{'-' * 9}|{'-' * 8}|{'-' * 8}|",
    ]
    for label, key, ref in rows:
        ratio = r[ref] / r[key]
        lines.append(f"| {label:<46} | {r[key]:7.2f} | {gb / r[key]:6.2f} | {ratio:6.2f} |")
    sync = r["ckpt_save"]
    lines.append(
        f"| {'async save: blocking (vs sync save time)':<46} | {r['async_blocking']:7.2f} | "
        f"{'':>6} | {r['async_blocking'] / sync:6.2f} |"
    )
    lines.append(
        f"| {'async save: total until committed':<46} | {r['async_total']:7.2f} | "
        f"{gb / r['async_total']:6.2f} | {r['async_total'] / sync:6.2f} |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write")
    args = parser.parse_args()
    where = tempfile.mkdtemp(prefix="fsdpkit-ckpt-bench-", dir=args.dir)
    try:
        results = run_ranks(
            _bench, world_size=2, args=(args.layers, args.dim, args.reps, where), timeout_s=1200
        )
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print(_table(results[0]))


if __name__ == "__main__":
    main()
