"""Does a mixture-of-experts step's memory depend on the routing? Per step: the true peak
and how unevenly the router spread the tokens.

    python bench/moe_routing_memory.py               # Mixtral and Qwen3-MoE, 12 steps
    python bench/moe_routing_memory.py --steps 20 --lr 0.001
    python bench/moe_routing_memory.py --render-docs   # only re-render docs/planner.md

Trains bench/plan_accuracy.py's HX (Mixtral) and HQ3 (Qwen3-MoE) rows without AC on 2
gloo ranks (4 experts, top 2, d128, 3 layers, 2 x 128 tokens per rank, fp32) with the
trainer's own builder and step, the router loss at its config coefficient. For every
steady-state step it records the true peak of live CPU tensor memory (c10's process-wide
count, [Note: measuring CPU peaks]; max over ranks) and the router loss's own metric
``expert_load_max``: the busiest expert's share of a layer's routed rows x experts
(1.0 = balanced; experts / top_k = 2.0 = every token of a layer chose that expert,
the worst routing top-2 allows). Each model runs at a low and a high learning rate
(``--lr``): the routers stay near their random start, or drift from balance. The
traced plan of the same row is printed beside.
The claim checked ([Note: routed activations in the plan]): with transformers'
grouped_mm experts the peak does not follow ``expert_load_max``. Memory is a byte count,
not a timing, so other load on the machine does not change it.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import results_io
from plan_accuracy_cases import FULL, Case

from fsdpkit.planner import plan
from fsdpkit.testing import run_ranks

NAME = "moe_routing_memory"
DOCS = results_io.ROOT / "docs" / "planner.md"
MIB = 2**20
ROWS = {"Mixtral (HX)": "HX", "Qwen3-MoE (HQ3)": "HQ3"}


def _worker(rank: int, world: int, cfg: Any, steps: int) -> list[tuple[int, float]]:
    import torch

    from fsdpkit.config import parallel_dims
    from fsdpkit.cpumem import enable_process_wide_accounting, live_bytes, peak_bytes
    from fsdpkit.models.accessors import input_vocab
    from fsdpkit.sharding.mesh import build_mesh
    from fsdpkit.trainable.build import build_unsharded, shard_trainable
    from fsdpkit.trainable.step import step_options, synthetic_batches, train_step

    enable_process_wide_accounting()
    base = live_bytes()
    dims = parallel_dims(cfg, world_size=world, local_world_size=world)
    mesh = build_mesh(dims, device_type="cpu")
    unsharded = build_unsharded(cfg, vocab_size=1, device_type="cpu", shape=None)
    run = shard_trainable(unsharded, cfg, mesh=mesh, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(dims.dp_rank(rank))
    batches = synthetic_batches(
        cfg, dp_world=dims.dp, vocab_size=input_vocab(run.model, default=256), generator=gen
    )

    def step() -> None:
        train_step(run.model, run.optimizer, batches, loss_fn=run.loss_fn, **step_options(cfg))

    step()  # AdamW states
    run.loss_fn.step_metrics()
    out = []
    for _ in range(steps):
        peak = peak_bytes(step) - base
        out.append((peak, run.loss_fn.step_metrics()["expert_load_max"]))
    return out


def measure(case: Case, *, steps: int) -> dict[str, Any]:
    cfg = case.config()
    per_rank = run_ranks(_worker, world_size=case.world, args=(cfg, steps), timeout_s=900)
    peaks = [max(r[i][0] for r in per_rank) for i in range(steps)]
    loads = [per_rank[0][i][1] for i in range(steps)]  # every rank holds the same
    traced = plan(cfg, world_size=case.world, trace=True).memory.peak.bytes
    return {"peaks": peaks, "load_max": loads, "traced": traced}


def _above(r: dict[str, Any], median: float) -> str:
    """Steps that peaked above the median by more than 1 KiB (allocator rounding):
    "+1.17 MiB (2.00)", or "none"."""
    high = [
        f"+{(p - median) / MIB:.2f} MiB ({load:.2f})"
        for p, load in zip(r["peaks"], r["load_max"], strict=True)
        if p - median > 1024
    ]
    return ", ".join(high) or "none"


HEADER = (
    "| model | lr | steps | load_max min..max | peak at lowest load | at highest "
    "| median | traced | traced vs median | steps above the median (their load_max) |"
)


def table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The markdown table of the measured rows."""
    out = [HEADER, "|" + " --- |" * 10]
    for label, r in rows.items():
        loads, peaks, median = r["load_max"], r["peaks"], r["median"]
        lo = min(range(len(loads)), key=lambda i: loads[i])
        hi = max(range(len(loads)), key=lambda i: loads[i])
        out.append(
            f"| {label.rsplit(' lr ', 1)[0]} | {r['lr']:g} | {len(peaks)} "
            f"| {min(loads):.2f}..{max(loads):.2f} "
            f"| {peaks[lo] / MIB:.3f} MiB | {peaks[hi] / MIB:.3f} MiB "
            f"| {median / MIB:.3f} MiB | {r['traced'] / MIB:.3f} MiB "
            f"| {(r['traced'] - median) / median:+.2%} | {_above(r, median)} |"
        )
    return out


def render(results: dict[str, Any]) -> str:
    """docs/planner.md's block."""
    return "\n".join([*table(results["rows"]), "", "By " + results_io.provenance(results, NAME)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--lr", type=float, nargs="+", default=[1e-5, 0.01], help="train.lr per row"
    )
    parser.add_argument("--render-docs", action="store_true", help="only re-render the docs")
    args = parser.parse_args()
    if not args.render_docs:
        rows = {}
        for (label, model), lr in ((m, lr) for m in ROWS.items() for lr in args.lr):
            r = measure(Case(label, 2, model, (FULL, f"train.lr={lr}")), steps=args.steps)
            rows[f"{label} lr {lr:g}"] = r | {"median": statistics.median(r["peaks"]), "lr": lr}
        results_io.write(NAME, steps=args.steps, lr=args.lr, rows=rows)
    results = results_io.read(NAME)
    print("\n".join(table(results["rows"])))
    results_io.render_into(DOCS, NAME, render(results))


if __name__ == "__main__":
    main()
