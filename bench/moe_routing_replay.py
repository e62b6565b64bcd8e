"""What a MoE plan under expert parallelism misses besides the routing: each rank's real
routing, replayed into the trace.

    python bench/moe_routing_replay.py              # the ep rows of plan_accuracy, 6 steps
    python bench/moe_routing_replay.py --steps 3
    python bench/moe_routing_replay.py --render-docs   # only re-render docs/planner.md

Trains bench/plan_accuracy.py's "E" rows under ``parallel.ep`` without a capacity factor
(the trainer's own builder and step on gloo ranks, fsdpkit.planner.traced.measure) and records,
per step and rank, the true peak of live CPU tensor memory ([Note: measuring CPU peaks])
and the rank's own load of each MoE layer (received rows / its balanced tokens x top_k,
``moe_layer_loads``, [Note: routing imbalance] in fsdpkit.sharding.experts.dispatch). For every
step the rank that peaked highest is planned by tracing at exactly its loads
(``Routing.by_layer``, [Note: routing in the plan]) and at a balanced step, and both are
compared with that rank's own peak. A replayed error near zero says the model of the
step holds everything but the routing (the all-to-all buffers, the counts exchange, the
dispatch's gradients, their lifetimes). Memory is a byte count, not a timing: other
load on the machine does not change it.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import results_io
from plan_accuracy_cases import CASES, Case

from fsdpkit.planner import plan
from fsdpkit.planner.experts.routing import Routing
from fsdpkit.planner.traced.measure import measure_step_records
from fsdpkit.testing import run_ranks

NAME = "moe_routing_replay"
DOCS = results_io.ROOT / "docs" / "planner.md"
ROWS = [
    c for c in CASES if c.name.startswith("E ") and "ep2" in c.name and "capacity" not in c.name
]
"""The ep rows of bench/plan_accuracy.py whose routing is the router's alone."""


def measure(case: Case, *, steps: int) -> list[dict[str, Any]]:
    """Per step: the rank that peaked highest, its peak and its layers' loads."""
    specs = [(case.name, case.config(), case.shape())]
    per_rank = run_ranks(
        measure_step_records, world_size=case.world, args=(specs, steps), timeout_s=1800
    )
    out = []
    for i in range(steps):
        ranks = [r[case.name][i] for r in per_rank]
        rank = max(range(case.world), key=lambda k: ranks[k]["peak"])
        out.append(
            {"rank": rank, "peak": ranks[rank]["peak"], "loads": ranks[rank]["moe_layer_loads"]}
        )
    return out


def replay(case: Case, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Each step's busiest rank traced at its own loads, and the balanced trace."""
    cfg = case.config()
    balanced = plan(cfg, world_size=case.world, trace=True).memory.peak.bytes
    for s in steps:
        loads = tuple(s["loads"])
        at = Routing(statistics.fmean(loads), max(loads), "replayed", by_layer=loads)
        s["replayed"] = plan(cfg, world_size=case.world, trace=True, routing=at).memory.peak.bytes
    return {"configuration": case.name, "world": case.world, "balanced": balanced, "steps": steps}


def _range(values: list[float], fmt: str) -> str:
    return f"{format(min(values), fmt)} .. {format(max(values), fmt)}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| configuration | ranks | steps | busiest rank's layer loads | balanced err "
        "| replayed err |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        steps = r["steps"]
        loads = [x for s in steps for x in s["loads"]]
        balanced = [(r["balanced"] - s["peak"]) / s["peak"] for s in steps]
        replayed = [(s["replayed"] - s["peak"]) / s["peak"] for s in steps]
        out.append(
            f"| {r['configuration']} | {r['world']} | {len(steps)} | {_range(loads, '.3f')} "
            f"| {_range(balanced, '+.2%')} | {_range(replayed, '+.2%')} |"
        )
    return out


def render(results: dict[str, Any]) -> str:
    """docs/planner.md's block: per row, the range over its steps."""
    return "\n".join([*table(results["rows"]), "", "By " + results_io.provenance(results, NAME)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--render-docs", action="store_true", help="only re-render the docs")
    args = parser.parse_args()
    if not args.render_docs:
        rows = [replay(c, measure(c, steps=args.steps)) for c in ROWS]
        results_io.write(NAME, steps=args.steps, rows=rows)
    results = results_io.read(NAME)
    print("\n".join(table(results["rows"])))
    results_io.render_into(DOCS, NAME, render(results))


if __name__ == "__main__":
    main()
