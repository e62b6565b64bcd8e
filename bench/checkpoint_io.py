"""Checkpoint I/O against the disk's raw speed, step by step; async vs sync blocking.

    .venv/bin/python bench/checkpoint_io.py [--reps 5] [--layers 6] [--dim 768] [--dir /tmp]
    .venv/bin/python bench/checkpoint_io.py --large     # ~1B params, ~12 GB: needs the disk/RAM
    .venv/bin/python bench/checkpoint_io.py --render-docs   # only re-render docs/checkpoints.md

A Llama (~62M params by default) with AdamW state (~750 MB in fp32) is sharded over 2
CPU ranks. In the same run and directory each rank also writes and reads its share of
the bytes with plain sequential I/O (``write`` + fsync; ``readinto`` an 8 MiB buffer
after evicting the file from the page cache), so "vs raw" compares like with like.

Cold reads: before every read the files are fsync'ed and dropped from the page cache
with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (the host's own cache, on a VM, may still
hold them; raw and checkpoint reads get the same treatment).

Each repetition runs every operation once; the order of the write group and of the
read group rotates from one repetition to the next, so drift on a shared machine hits
all rows alike. Every time is wall time between two barriers (both ranks done); the
step rows are the slower rank's seconds inside the operation; all are medians over
the repetitions. "raw ... (control)" repeats the raw operation: its ratio shows the
noise. The async rows reuse one Checkpointer, as a training run does (its first save
allocates the staging buffers and is reported separately). Writes
``bench/results/checkpoint_io.json`` (every figure, the slower rank's) and renders
docs/checkpoints.md's step-by-step table from it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import results_io
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


def _evict_dir(ckpt: Path) -> None:
    dist.barrier()
    _evict([p for p in ckpt.iterdir() if p.is_file()])
    dist.barrier()


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


class _TimedState(ModelOptimizerState):
    """ModelOptimizerState that records the seconds spent in FSDP's state-dict calls
    (get_state_dict before DCP plans a save or load, set_state_dict after a load)."""

    seconds: dict[str, float] = {"state_dict": 0.0, "load_state_dict": 0.0}

    def state_dict(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        out = super().state_dict()
        self.seconds["state_dict"] += time.perf_counter() - t0
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        super().load_state_dict(state_dict)
        self.seconds["load_state_dict"] += time.perf_counter() - t0

    @classmethod
    def take(cls) -> dict[str, float]:
        out = dict(cls.seconds)
        cls.seconds.update(state_dict=0.0, load_state_dict=0.0)
        return out


def _raw_read_big(path: Path, buf: bytearray) -> None:
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while n := f.readinto(view[done : done + _CHUNK]):
            done += n


def _build(layers: int, dim: int, ffn: int) -> tuple[dict[str, Any], Llama]:
    cfg = preset("tiny", n_layers=layers, dim=dim, n_heads=dim // 64, n_kv_heads=4, ffn_dim=ffn)
    cfg = preset("tiny", **{**cfg.to_dict(), "vocab_size": 32000})
    with torch.device("meta"):
        model = Llama(cfg)
    shard(model, RunConfig(), mesh=build_mesh(device_type="cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.zeros(1, 16, dtype=torch.long)).float().pow(2).mean().backward()
    opt.step()  # materialize AdamW state
    opt.zero_grad(set_to_none=True)
    return {"app": _TimedState(model, opt)}, model


def _rotate(ops: list[tuple[str, Callable[[], float]]], rep: int) -> dict[str, float]:
    k = rep % len(ops)
    return {name: fn() for name, fn in ops[k:] + ops[:k]}


class _Rep:
    """One repetition's operations on one rank."""

    def __init__(self, rep: int, state: dict[str, Any], base: Path, rank: int) -> None:
        self.rep, self.state, self.base, self.rank = rep, state, base, rank
        self.ckpt = base / "sync" / "checkpoints" / f"step-{rep:08d}"
        self.plain = base / f"plain-{rep}"
        self.raw = base / f"raw-{rank}.bin"
        self.steps: dict[str, float] = {}

    def save(self) -> float:
        saver = Checkpointer(run_dir=self.base / "sync", cfg=CheckpointConfig(keep=1), run_meta={})
        _TimedState.take()
        seconds = _timed(lambda: saver.save(self.rep, self.state, blocking=True))
        self.steps |= {f"save.{k}": v for k, v in saver.last_save_timings.items()}
        self.steps["save.state_dict"] = _TimedState.take()["state_dict"]
        return seconds

    def resume(self) -> float:
        _evict_dir(self.ckpt)
        cfg = CheckpointConfig(resume=str(self.ckpt))
        loader = Checkpointer(run_dir=self.base / "other", cfg=cfg, run_meta={})
        _TimedState.take()
        seconds = _timed(lambda: loader.resume(self.state))
        self.steps |= {f"resume.{k}": v for k, v in loader.last_resume_timings.items()}
        self.steps |= {f"resume.{k}": v for k, v in _TimedState.take().items()}
        return seconds

    def fixed(self) -> dict[str, float]:
        """The same number of tensors at one element each, under this rank's own keys
        (nothing deduplicated): the per-tensor cost of DCP planning, collectives,
        serialization and our parsing, without the bytes."""
        leaves = [k for k, v in _flat(self.state["app"].state_dict()) if torch.is_tensor(v)]
        tiny = {f"r{self.rank}.{k}": torch.zeros(1) for k in leaves}
        run = self.base / f"tiny-{self.rep}"
        saver = Checkpointer(run_dir=run, cfg=CheckpointConfig(), run_meta={})
        out = {"fixed_save": _timed(lambda: saver.save(1, {"t": tiny}, blocking=True))}
        loader = Checkpointer(run_dir=run, cfg=CheckpointConfig(), run_meta={})
        out["fixed_resume"] = _timed(lambda: loader.resume({"t": tiny}))
        out["items"] = float(len(leaves))
        return out

    def raw_write(self, data: bytes) -> float:
        return _timed(lambda: _raw_write(self.raw, data))

    def raw_read(self) -> float:
        _evict([self.raw])
        return _timed(lambda: _raw_read(self.raw))

    def raw_read_big(self) -> float:
        """Into memory as large as the file, allocated and touched beforehand, as a
        load's target tensors are: the floor for any load that keeps what it reads."""
        buf = bytearray(self.raw.stat().st_size)
        _evict([self.raw])
        return _timed(lambda: _raw_read_big(self.raw, buf))

    def dcp_load(self) -> float:
        _evict_dir(self.plain)
        return _timed(lambda: dcp.load(self.state, checkpoint_id=str(self.plain)))


def _flat(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in _flat(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), obj)]


def _one_rep(rep: int, state: dict[str, Any], base: Path, rank: int, asy: Checkpointer) -> dict:
    r = _Rep(rep, state, base, rank)
    out = {"ckpt_save": r.save()}  # first: the raw rows write exactly this rank's share
    mine = sum(p.stat().st_size for p in r.ckpt.iterdir() if p.name.startswith(f"__{rank}_"))
    data = np.random.default_rng(rep).bytes(mine)
    out |= _rotate(
        [
            ("raw_write", lambda: r.raw_write(data)),
            ("dcp_save", lambda: _timed(lambda: dcp.save(state, checkpoint_id=str(r.plain)))),
            ("raw_write_control", lambda: r.raw_write(data)),
        ],
        rep,
    )
    out |= _rotate(
        [
            ("raw_read", r.raw_read),
            ("ckpt_resume", r.resume),
            ("dcp_load", r.dcp_load),
            ("raw_read_control", r.raw_read),
            ("raw_read_big", r.raw_read_big),
        ],
        rep,
    )
    out |= r.fixed()
    out["async_total"] = _timed(lambda: (asy.save(rep, state), asy.wait()))
    out["async_blocking"] = asy.last_blocking_s
    out |= r.steps | {f"async.{k}": v for k, v in asy.last_save_timings.items()}
    out["bytes"] = float(sum(p.stat().st_size for p in r.ckpt.iterdir()))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(r.plain, ignore_errors=True)
    r.raw.unlink()
    return out


def _bench(rank: int, world: int, shape: tuple[int, int, int], reps: int, where: str) -> dict:
    state, model = _build(*shape)
    params = sum(p.numel() for p in model.parameters())
    base = Path(where)
    cfg = CheckpointConfig(keep=1, async_save=True)
    asy = Checkpointer(run_dir=base / "async", cfg=cfg, run_meta={})
    asy.save(0, state)  # allocates the staging buffers, as a run's first async save does
    asy.wait()
    first = {"async_first_blocking": asy.last_blocking_s, "staging_bytes": asy.staging_bytes}
    runs = [_one_rep(rep + 1, state, base, rank, asy) for rep in range(reps)]
    asy.close()
    keys = set.intersection(*(set(r) for r in runs))
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    return med | first | {"params": params}


def _slowest(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Wall times are the same on every rank; per-rank step times: the slower rank."""
    out = dict(results[0])
    for key in out:
        if "." in key or key == "staging_bytes":
            out[key] = max(r.get(key, 0.0) for r in results)
    return out


_ROWS = [
    # label, result key, reference: "raw_x" = ratio raw/this (a speed), "/x" = this/x
    ("raw sequential write + fsync", "raw_write", "raw_write"),
    ("raw sequential write + fsync (control)", "raw_write_control", "raw_write"),
    ("dcp.save (plain FileSystemWriter)", "dcp_save", "raw_write"),
    ("Checkpointer.save, sync", "ckpt_save", "raw_write"),
    ("  state_dict() (FSDP get_state_dict)", "save.state_dict", None),
    ("  write (DCP plan + serialize + write + fsync)", "save.write", None),
    ("    of which write() into the page cache", "save.write_calls", None),
    ("    of which crc32 in-line (checksum)", "save.checksum", None),
    ("    of which fsync (after write-behind)", "save.fsync", None),
    ("  commit (gather records, fsdpkit.json, rename)", "save.commit", None),
    ("raw sequential read (cold cache)", "raw_read", "raw_read"),
    ("raw sequential read (cold cache, control)", "raw_read_control", "raw_read"),
    ("raw read into a state-sized buffer (cold)", "raw_read_big", "raw_read"),
    ("dcp.load (plain FileSystemReader, cold)", "dcp_load", "raw_read"),
    ("Checkpointer.resume, verified (cold)", "ckpt_resume", "raw_read"),
    ("  precheck (sizes; .metadata crc32 + safe unpickle)", "resume.precheck", None),
    ("  load (DCP plan + read + verify + set state)", "resume.load", None),
    ("    of which read (preadv into the targets)", "resume.read", None),
    ("    of which crc32 in-line (verify)", "resume.checksum", None),
    ("    of which state_dict() (FSDP get_state_dict)", "resume.state_dict", None),
    ("    of which load_state_dict() (FSDP set_state_dict)", "resume.load_state_dict", None),
    ("per-tensor cost: Checkpointer.save, same tensors x 1 elem", "fixed_save", None),
    ("per-tensor cost: Checkpointer.resume, same tensors x 1 elem", "fixed_resume", None),
    ("async save: blocking (vs sync save)", "async_blocking", "/ckpt_save"),
    ("  of which staging copy (incl. state_dict())", "async.staging", None),
    ("async save: first save, allocates buffers (vs sync)", "async_first_blocking", "/ckpt_save"),
    ("async save: total until committed (vs sync)", "async_total", "/ckpt_save"),
    ("  background write (DCP, from the staging buffers)", "async.write", None),
    ("    of which write() into the page cache", "async.write_calls", None),
    ("  background commit (+ retention of the previous one)", "async.commit", None),
]


NAME = "checkpoint_io"
DOCS = results_io.ROOT / "docs" / "checkpoints.md"


def _table(r: dict[str, Any]) -> str:
    """The step-by-step table in Markdown: seconds, GB/s against the checkpoint's bytes,
    and the ratio against the row's reference (raw speed / this, or this / sync save)."""
    gb = r["bytes"] / 1e9
    lines = [
        f"Llama {r['params'] / 1e6:.1f}M params + AdamW, checkpoint {gb:.3f} GB, 2 CPU ranks; "
        "ratio: raw seconds / the row's for save and load rows (1.00 = raw disk speed), the "
        "row's seconds / a sync save for async rows.",
        "",
        "| operation | seconds | GB/s | ratio |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, key, ref in _ROWS:
        seconds = r[key]
        rate = f"{gb / seconds:.2f}" if ref and not ref.startswith("/") else ""
        ratio = ""
        if ref:
            ratio = f"{seconds / r[ref[1:]]:.2f}" if ref[0] == "/" else f"{r[ref] / seconds:.2f}"
        lines.append(f"| {label.strip()} | {seconds:.3f} | {rate} | {ratio} |")
    direct = r["resume.direct_bytes"] / max(r["resume.bytes"], 1)
    lines += [
        "",
        f"{r['items']:.0f} tensors per rank; staging buffers held per rank: "
        f"{r['staging_bytes'] / 1e6:,.1f} MB; bytes read straight into the targets on "
        f"resume: {direct:.1%} of this rank's reads.",
    ]
    return "\n".join(lines)


def render(results: dict[str, Any]) -> str:
    """docs/checkpoints.md's table (tests/unit/test_bench_docs.py checks it)."""
    head = results_io.provenance(results, NAME) + f" Medians of {results['reps']} repetitions."
    return head + "\n\n" + _table(results["slowest"]) + "\n"


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The model's shape, where to write, --render-docs (bench/checkpoint_staging.py's too)."""
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write")
    parser.add_argument("--render-docs", action="store_true", help="only re-render the docs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--large", action="store_true", help="16 layers x 2048 (~1B params)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if args.render_docs:
        render_docs()
        return
    shape = (16, 2048, 5632) if args.large else (args.layers, args.dim, args.ffn)
    where = tempfile.mkdtemp(prefix="fsdpkit-ckpt-bench-", dir=args.dir)
    try:
        results = run_ranks(_bench, world_size=2, args=(shape, args.reps, where), timeout_s=3600)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    results = json.loads(json.dumps(results, default=float))  # NumPy scalars: plain floats
    slowest = _slowest(results)
    print(_table(slowest))
    results_io.write(NAME, shape=list(shape), reps=args.reps, slowest=slowest, ranks=results)
    render_docs()


if __name__ == "__main__":
    main()
