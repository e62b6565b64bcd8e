"""Selective activation checkpointing and compiled blocks: tokens/s and peak memory on CPU.

    python bench/act_levers.py [--reps 6] [--steps 8]

Two tables, 2 gloo ranks, fp32, the trainer's own ``shard()``, AdamW and step:

- activations.mode none / selective / full on a model whose activations dominate
  (d=256, 4 blocks, GQA, seq 512, 2 sequences per rank);
- train.compile off / on for the tiny preset (seq 256, 4 per rank) and the same
  wider model.

Within one spawn every row's variants alternate, repetition by repetition (so load
from the other jobs on these shared cores hits them alike); each "control" row runs
the off setting twice, its ratio is the noise. Tokens/s excludes the first two
steps (compilation, AdamW state creation); compile_s is dynamo's own compile time
during them (fsdpkit.sharding.compile.compile_seconds). Peak memory is the true
per-rank peak of live tensors over one step (c10's allocator count,
fsdpkit.planner.traced.measure), max over ranks. The rows are meant for bench/levers.py's
LEVERS list: (name, off overrides, on overrides).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from fsdpkit.config import RunConfig, batch_split, load
from fsdpkit.cpumem import enable_process_wide_accounting, live_bytes, peak_bytes
from fsdpkit.loss.contract import next_token_loss
from fsdpkit.models.llama import Llama
from fsdpkit.planner.shapes.scenario import model_shape
from fsdpkit.sharding import shard
from fsdpkit.sharding.compile import compile_seconds
from fsdpkit.sharding.mesh import build_mesh
from fsdpkit.testing import run_ranks
from fsdpkit.trainable.optim import build_optimizer
from fsdpkit.trainable.step import train_step

WIDE = [
    "model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_dim=688", "model.vocab_size=2048", "data.seq_len=512",
    "train.micro_batch_size=2",
]  # fmt: skip
TINY = ["model.vocab_size=256", "data.seq_len=256", "train.micro_batch_size=4"]

# (table, row name, model overrides, off overrides, on overrides)
ROWS: list[tuple[str, str, list[str], list[str], list[str]]] = [
    ("ac", "selective vs none", WIDE, ["activations.mode=none"], ["activations.mode=selective"]),
    ("ac", "selective vs full", WIDE, ["activations.mode=full"], ["activations.mode=selective"]),
    ("ac", "control (none vs none)", WIDE, ["activations.mode=none"], ["activations.mode=none"]),
    ("compile", "compile, tiny preset", TINY, ["train.compile=false"], ["train.compile=true"]),
    ("compile", "compile, wide", WIDE, ["train.compile=false"], ["train.compile=true"]),
    (
        "compile",
        "compile + selective, wide",
        WIDE,
        ["activations.mode=selective"],
        ["activations.mode=selective", "train.compile=true"],
    ),
    ("compile", "control (eager vs eager)", TINY, ["train.compile=false"], ["train.compile=false"]),
]


def _config(model: list[str], overrides: list[str]) -> RunConfig:
    return load(None, ["model.preset=tiny", "precision.mode=fp32", *model, *overrides])


def _run(cfg: RunConfig, *, world: int, rank: int, steps: int) -> dict[str, float]:
    """Tokens/s (all ranks) over ``steps`` steady steps, compile seconds, step peak."""
    torch._dynamo.reset()  # every compiled run compiles (warm on-disk caches after the first)
    base = live_bytes()
    mesh = build_mesh(device_type="cpu")
    shape = model_shape(cfg)
    with torch.device("meta"):
        model = Llama(shape)
    shard(model, cfg, mesh=mesh)
    opt = build_optimizer(model, cfg.train)
    split = batch_split(cfg.train, dp_world=world)
    gen = torch.Generator().manual_seed(rank)
    size = (split.micro_batch, cfg.data.seq_len + 1)
    batches = [torch.randint(0, shape.vocab_size, size, generator=gen)]

    def step() -> None:
        train_step(model, opt, batches, loss_fn=next_token_loss, max_norm=1.0)

    c0 = compile_seconds()
    step(), step()  # compile, AdamW states
    compiled = compile_seconds() - c0
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    dt = time.perf_counter() - t0
    peak = peak_bytes(step) - base  # live tensors at the peak, model and states included
    tokens = split.micro_batch * world * cfg.data.seq_len * steps
    return {"tokens_per_s": tokens / dt, "compile_s": compiled, "peak": float(peak)}


def _worker(rank: int, world: int, reps: int, steps: int) -> dict[str, Any]:
    enable_process_wide_accounting()
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for rep in range(reps):
        for _, name, model, off, on in ROWS:
            order = [("off", off), ("on", on)] if rep % 2 == 0 else [("on", on), ("off", off)]
            for side, overrides in order:
                result = _run(_config(model, overrides), world=world, rank=rank, steps=steps)
                out.setdefault((name, side), []).append(result)
    return out


def _table(per_rank: list[dict[str, Any]], table: str) -> str:
    """Per row: median tokens/s of each side, the median of the per-repetition ratios
    (on / off of the same repetition, adjacent in time) and their range, peaks (max
    over ranks and runs), compile seconds (first run; median of the others)."""
    mib = 2**20
    head = (
        f"{'row':<28}{'off tok/s':>10}{'on tok/s':>10}{'ratio':>7}{'range':>13}"
        f"{'off peak':>10}{'on peak':>10}{'compile s':>12}"
    )
    lines = [head, "-" * len(head)]
    for kind, name, *_ in ROWS:
        if kind != table:
            continue
        runs = {s: [r["tokens_per_s"] for r in per_rank[0][(name, s)]] for s in ("off", "on")}
        tps = {s: statistics.median(v) for s, v in runs.items()}
        ratios = [on / off for on, off in zip(runs["on"], runs["off"])]
        peak = {
            s: max(max(r["peak"] for r in ranks[(name, s)]) for ranks in per_rank)
            for s in ("off", "on")
        }
        comp = [
            max(rk[(name, "on")][i]["compile_s"] for rk in per_rank) for i in range(len(ratios))
        ]
        later = f"{statistics.median(comp[1:]):.1f}" if len(comp) > 1 else "-"
        lines.append(
            f"{name:<28}{tps['off']:>10,.0f}{tps['on']:>10,.0f}{statistics.median(ratios):>7.3f}"
            f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>13}"
            f"{peak['off'] / mib:>9.1f}M{peak['on'] / mib:>9.1f}M{f'{comp[0]:.1f}/{later}':>12}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6, help="alternating repetitions")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    args = parser.parse_args(argv)
    # a fresh inductor cache: the first compiled run compiles cold, as a new machine does
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="act-levers-"))
    start = time.perf_counter()
    per_rank = run_ranks(_worker, world_size=2, args=(args.reps, args.steps), timeout_s=3600)
    print("activation checkpointing (off = the mode named first)")
    print(_table(per_rank, "ac"))
    print("\ntorch.compile per block (compile s: first run / median of the later ones)")
    print(_table(per_rank, "compile"))
    print(
        f"\n2 gloo ranks x 1 thread, fp32, median of {args.reps} alternating runs x "
        f"{args.steps} steps; {time.perf_counter() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
