"""The offloaded optimizer step: torch's AdamW kernels on FSDP2 shards, side by side.

    python bench/optimizer_step.py                     # 50M fp32 elements, 1 thread
    python bench/optimizer_step.py --elements 200e6 --threads 2 --reps 6
    python bench/optimizer_step.py --deepspeed         # + DeepSpeed's CPUAdam if it builds

With ``offload.params = true`` (and on CPU ranks) every rank runs AdamW on the CPU
over its fp32 shards: 16 bytes of state per element (param, grad, m, v), read and
written once per step. This builds one rank's shards as fsdpkit does — ``fully_shard``
on a 1-rank gloo mesh, so the parameters are DTensors, with Llama-like 2-D weights
and 1-D norms in the trainer's two parameter groups — fills the gradients, and times
``optimizer.step()`` for each ``train.optimizer_impl`` (for-loop, foreach, fused) in
alternating order (ABCABC...), each on its own optimizer with its own states. A
control row times the first implementation twice as two separate entries (same vs
same: the noise floor). Reported: median seconds per step, elements per second, and
each implementation's speed relative to the for-loop row (never to the control row:
that is the noise floor, not a baseline). Writes ``bench/results/optimizer_step.json``
and renders docs/levers.md's table from it (``--render-docs`` only re-renders).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import results_io
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdpkit.config import TrainConfig
from fsdpkit.trainable.optim import build_optimizer

NAME = "optimizer_step"
DOCS = results_io.ROOT / "docs" / "levers.md"
IMPLS = ("for-loop", "foreach", "fused")


def shards(elements: int, *, dim: int = 2048) -> nn.Module:
    """Blocks of Llama-like weights (4 d x d matrices and 2 d-vectors each) totalling
    about ``elements`` fp32 elements, sharded by FSDP2 (DTensor parameters)."""
    blocks = max(1, round(elements / (4 * dim * dim + 2 * dim)))
    model = nn.Sequential(
        *(
            nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(4)),
                          nn.LayerNorm(dim, bias=False), nn.LayerNorm(dim, bias=False))
            for _ in range(blocks)
        )
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (1,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def _deepspeed_step(model: nn.Module) -> Callable[[], None] | str:
    """DeepSpeed's CPU Adam (AdamW mode) on the local shards, or why it is not here."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception as exc:  # not installed, or its C++ op does not build
        return f"{type(exc).__name__}: {exc}"
    locals_ = [p.to_local().detach() for p in model.parameters()]  # leaves, same storage
    try:
        opt = DeepSpeedCPUAdam(locals_, lr=1e-4, adamw_mode=True)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    grads = [p.grad.to_local() for p in model.parameters()]
    for t, g in zip(locals_, grads):
        t.grad = g
    return opt.step


def steppers(model: nn.Module, *, deepspeed: bool) -> dict[str, Callable[[], None] | str]:
    out: dict[str, Callable[[], None] | str] = {}
    for impl in IMPLS:
        opt = build_optimizer(model, TrainConfig(optimizer_impl=impl))  # type: ignore[arg-type]
        opt.step()  # creates m and v
        out[impl] = opt.step
    control = build_optimizer(model, TrainConfig(optimizer_impl=IMPLS[0]))  # type: ignore[arg-type]
    control.step()
    out[f"{IMPLS[0]} (control)"] = control.step
    if deepspeed:
        out["deepspeed cpu_adam"] = _deepspeed_step(model)
    return out


def run(elements: int, *, reps: int, deepspeed: bool) -> tuple[int, dict[str, list[float] | str]]:
    model = shards(elements)
    numel = sum(p.numel() for p in model.parameters())
    runs = steppers(model, deepspeed=deepspeed)
    times: dict[str, list[float] | str] = {k: ([] if callable(v) else v) for k, v in runs.items()}
    for _ in range(reps):  # alternating: every implementation once per round
        for name, step in runs.items():
            if callable(step):
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)  # type: ignore[union-attr]
    return numel, times


def rows(numel: int, times: dict[str, list[float] | str]) -> list[dict[str, Any]]:
    """One row per implementation: median, spread and speed relative to the for-loop."""
    base = statistics.median(times[IMPLS[0]])  # type: ignore[arg-type]
    out: list[dict[str, Any]] = []
    for name, value in times.items():
        if isinstance(value, str):
            out.append({"implementation": name, "not_run": value[:200]})
            continue
        m = statistics.median(value)
        out.append(
            {
                "implementation": name,
                "median_s": round(m, 4),
                "min_s": round(min(value), 4),
                "max_s": round(max(value), 4),
                "melem_s": round(numel / m / 1e6, 1),
                "vs_for_loop": round(base / m, 2),
            }
        )
    return out


def render(results: dict[str, Any]) -> str:
    """docs/levers.md's table (tests/unit/test_bench_docs.py checks it)."""
    lines = [
        results_io.provenance(results, NAME),
        "",
        f"{results['elements'] / 1e6:.1f}M fp32 elements (DTensor, FSDP2), "
        f"{results['threads']} thread(s), torch {results['torch']}, {results['reps']} "
        "alternating rounds, median; speed relative to the for-loop row.",
        "",
        "| implementation | s/step | Melem/s | vs for-loop | runs |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for r in results["rows"]:
        if "not_run" in r:
            lines.append(f"| {r['implementation']} | - | - | - | not run: {r['not_run']} |")
            continue
        lines.append(
            f"| {r['implementation']} | {r['median_s']:.3f} | {r['melem_s']:,.1f} | "
            f"{r['vs_for_loop']:.2f}x | {r['min_s']:.3f}-{r['max_s']:.3f} s |"
        )
    return "\n".join(lines) + "\n"


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=float, default=50e6, help="fp32 elements per rank")
    parser.add_argument("--reps", type=int, default=6, help="alternating rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--deepspeed", action="store_true", help="add DeepSpeed's CPUAdam")
    parser.add_argument(
        "--render-docs", action="store_true", help="only re-render docs/levers.md's table"
    )
    args = parser.parse_args(argv)
    if args.render_docs:
        render_docs()
        return 0
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            numel, times = run(int(args.elements), reps=args.reps, deepspeed=args.deepspeed)
        finally:
            dist.destroy_process_group()
    print(
        f"AdamW step over one rank's offloaded shards: {numel / 1e6:.1f}M fp32 elements "
        f"(DTensor, FSDP2), {args.threads} thread(s), torch {torch.__version__}, "
        f"{args.reps} alternating rounds, median"
    )
    table = rows(numel, times)
    for r in table:
        print(r)
    results_io.write(
        NAME,
        elements=numel,
        threads=args.threads,
        reps=args.reps,
        torch=torch.__version__,
        rows=table,
    )
    render_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
