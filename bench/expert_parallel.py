"""Expert parallelism next to FSDP only: tokens/s and per-rank memory of the same
mixture-of-experts training at 4 CPU ranks (gloo), bench/model_parallel.py's method
and machinery with the built-in MoE model.

    .venv/bin/python bench/expert_parallel.py                # 3 rounds
    .venv/bin/python bench/expert_parallel.py --quick        # 1 round, 4 steps (a smoke run)
    .venv/bin/python bench/expert_parallel.py --render-docs docs/parallelism.md

Rows (every setting but the layout identical: the built-in MoE model at dim 256, 4
blocks, 8 query / 4 key-value heads, 8 experts of 32 hidden units, top 2, seq 1024,
fp32, global batch 4 sequences per step, micro-batch cap 2, the built-in corpus):

- FSDP only: ``parallel.ep=1`` (every rank gathers every expert of a block);
- efsdp 2 x ep 2: ``parallel.ep=2`` (4 experts per rank, sharded over 2; tokens
  dispatched with all-to-alls);
- ep 4: ``parallel.ep=4`` (2 experts per rank, not sharded further);
- FSDP only again: the A/A control.

Each run is bench/model_parallel.py's: the library's build path on 4 spawned gloo ranks,
resident set after the build and at the peak, tokens/s over steps 3..N, rounds in A B
C A' order, ratios median over median vs FSDP only with the per-round min-max; the loss
column is the largest |loss - FSDP only's| (the layouts train the same math, within
the all-to-all's summation order). Writes bench/results/expert_parallel.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import results_io
from model_parallel import GLOBAL_BATCH, SKIP, WORLD, measure, rows_of, table

NAME = "expert_parallel"
MODEL = [
    "model.preset=moe-tiny", "model.dim=256", "model.n_layers=4", "model.n_heads=8",
    "model.n_kv_heads=4", "model.experts=8", "model.top_k=2", "precision.mode=fp32",
    f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=2",
]  # fmt: skip
ROWS: dict[str, tuple[str, list[str]]] = {
    "fsdp": ("FSDP only (shard 4)", ["parallel.ep=1"]),
    "ep2": ("efsdp 2 x ep 2", ["parallel.ep=2"]),
    "ep4": ("ep 4", ["parallel.ep=4"]),
    "fsdp-B": ("FSDP only again (A/A control)", ["parallel.ep=1"]),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="1 round of 4 steps")
    parser.add_argument("--render-docs", metavar="FILE", type=Path, help="only re-render FILE")
    args = parser.parse_args()
    if args.render_docs:
        results_io.render_into(args.render_docs.resolve(), NAME, render(results_io.read(NAME)))
        return
    if args.quick:
        args.rounds, args.steps = 1, 4
    os.environ["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    measured, loads = measure(args, rows=ROWS, model=MODEL)
    flags = f"--rounds {args.rounds} --steps {args.steps} --seq {args.seq}"
    results_io.write(
        NAME,
        command=f"python bench/expert_parallel.py {flags}",
        settings={
            "world": WORLD,
            "seq": args.seq,
            "steps": args.steps,
            "skip": SKIP,
            "rounds": args.rounds,
            "model": MODEL,
        },
        minutes=round((time.monotonic() - t0) / 60, 2),
        load_1min_per_round=loads,
        rows=rows_of(measured, ROWS),
    )
    print(render(results_io.read(NAME)))


def render(results: dict[str, Any]) -> str:
    """The docs block (docs/parallelism.md; tests/unit/test_bench_docs.py checks it)."""
    s, loads = results["settings"], results["load_1min_per_round"]
    lines = [
        results_io.provenance(results, NAME),
        "",
        f"Built-in MoE model, dim 256, 4 blocks, 8 experts (top 2), seq {s['seq']}, fp32; "
        f"global batch 4 sequences per step; {s['world']} gloo ranks; {s['steps']} steps per "
        f"run, {s['rounds']} round(s), {results['minutes']:.1f} min; 1-minute load after "
        f"each round {min(loads):.1f}-{max(loads):.1f} on a shared 2-core machine.",
        "",
        *table(results["rows"]),
    ]
    control = next(r for r in results["rows"] if r["key"] == "fsdp-B")["ratio"]
    lines += [
        "",
        f"The A/A control lands at {control[0]:.2f} of FSDP only ({control[1]:.2f}-"
        f"{control[2]:.2f} per round): a layout's ratio inside that span shows nothing. "
        "On gloo over 2 shared cores every all-to-all runs on the compute thread and "
        "4 processes time-share the cores, so these ratios are not what ep costs on GPUs "
        "(bench/gpu_model_parallel.py has MoE rows, grouped GEMMs on NCCL, not yet run).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
