"""Planner accuracy: predicted vs measured per-rank peak memory on real CPU ranks.

    python bench/plan_accuracy.py            # the whole matrix (~6-10 min on 2 cores)
    python bench/plan_accuracy.py --quick    # the subset the tests use
    python bench/plan_accuracy.py --only V   # rows whose name starts with V
    python bench/plan_accuracy.py --only MP --merge   # rerun rows into the results file
    python bench/plan_accuracy.py --render-docs   # only re-render docs/planner.md's table

Every configuration trains real steps with the trainer's own model, ``shard()`` and
step function on gloo ranks (fsdpkit.testing.run_ranks) and measures the true peak of
live CPU tensor memory of each of ``--steps`` steady-state steps (c10's process-wide
allocator count, see [Note: measuring CPU peaks] in fsdpkit.cpumem; the max
over ranks per step). "typical" is the median step, "worst" the highest. The parent
plans the same configuration analytically and traced and prints the table.
Targets: within 3% of the typical step and 5% of the worst one (issue 8); the
planner's own bound (peak + the late-free spread it reports) should cover the worst.
A run of the whole matrix writes ``bench/results/plan_accuracy.json`` (every row) and
renders docs/planner.md's table from it; ``--only`` / ``--quick`` runs print only (a
subset must not replace the matrix the docs quote), unless ``--merge``: then the rows
it measured replace their records in the file (new ones are added in matrix order),
the others keep theirs, and the file's ``reruns`` say which rows were measured when,
by which command and commit (the table's prose quotes them). The "MP" rows (tensor
and context parallelism, issue 23) are planned both ways too: the traced planner runs
them on the run's N-D mesh of a fake process group. The rows themselves
(model shapes and overrides) are bench/plan_accuracy_cases.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import results_io
from plan_accuracy_cases import CASES, QUICK, Case

from fsdpkit.planner import plan
from fsdpkit.planner.experts.routing import BALANCED, MEAN_KEY, Routing, from_records
from fsdpkit.planner.traced.measure import measure_step_records
from fsdpkit.testing import run_ranks


def measure(cases: list[Case], *, steps: int) -> dict[tuple[str, int], Measured]:
    """True per-rank peaks of ``steps`` steps (per step the max over ranks), and under
    expert parallelism the routing the run recorded, one spawn per world size."""
    out = {}
    for world in sorted({c.world for c in cases}):
        group = [c for c in cases if c.world == world]
        specs = [(c.name, c.config(), c.shape()) for c in group]
        per_rank = run_ranks(
            measure_step_records, world_size=world, args=(specs, steps), timeout_s=1800
        )
        for c in group:
            records = [r[c.name] for r in per_rank]
            peaks = [max(step["peak"] for step in ranks) for ranks in zip(*records)]
            routed = MEAN_KEY in records[0][0]  # every rank holds the same maxima
            routing = from_records(records[0], source="its run") if routed else None
            out[(c.name, world)] = Measured(peaks, routing)
    return out


@dataclass(frozen=True)
class Measured:
    peaks: list[int]
    """The max over ranks of each step's peak."""
    routing: Routing | None
    """Under ep, the median step's routing the run recorded ([Note: routing in the plan])."""


@dataclass(frozen=True)
class Result:
    case: Case
    steps: tuple[int, ...]
    """Measured peak of each step."""
    analytic: int | None
    """None: a model the analytic planner does not replay (traced only)."""
    traced: int | None
    """None: not traced (records written before the traced planner took tp / cp)."""
    spread: int
    """The planner's reported step-to-step spread above its peak."""
    where: str
    routing: Routing | None = None
    """Under ep: the routing ``traced`` was planned at, the run's own."""
    balanced: int | None = None
    """Under ep: the traced peak of a balanced step (the plan's default)."""

    @property
    def typical(self) -> int:
        return int(statistics.median(self.steps))

    @property
    def worst(self) -> int:
        return max(self.steps)


def _planned(c: Case, routing: Routing = BALANCED) -> tuple[int | None, int | None, Any]:
    """(analytic peak, traced peak, the memory plan quoted): the traced plan, with the
    analytic one riding along where the formulas cover the model."""
    if c.config().parallel.pp > 1:  # pipelines are planned analytically, rank by rank
        analytic = plan(c.config(), world_size=c.world, trace=False)
        return analytic.memory.peak.bytes, None, analytic.memory
    traced = plan(c.config(), world_size=c.world, trace=True, routing=routing)
    other = traced.other
    return (
        (other.peak.bytes if other is not None else None),
        traced.memory.peak.bytes,
        (other or traced.memory),
    )


def rows(cases: list[Case], *, steps: int) -> list[Result]:
    """Measured, analytic and traced peaks of every case; a case under expert
    parallelism is traced at the routing its own run recorded, and balanced beside."""
    measured = measure(cases, steps=steps)
    out = []
    for c in cases:
        m = measured[(c.name, c.world)]
        analytic, traced, memory = _planned(c, m.routing or BALANCED)
        balanced = _planned(c)[1] if m.routing is not None else None
        out.append(
            Result(
                case=c,
                steps=tuple(m.peaks),
                analytic=analytic,
                traced=traced,
                spread=memory.spread,
                where=f"{memory.peak.phase}: {memory.peak.where}",
                routing=m.routing,
                balanced=balanced,
            )
        )
    return out


NAME = "plan_accuracy"
DOCS = results_io.ROOT / "docs" / "planner.md"
MIB = 2**20


def record(r: Result) -> dict[str, Any]:
    """One row of the results file: the measured steps and both plans, in bytes."""
    return {
        "configuration": r.case.name, "world": r.case.world, "steps": list(r.steps),
        "typical": r.typical, "worst": r.worst, "analytic": r.analytic, "traced": r.traced,
        "spread": r.spread, "peak_at": r.where,
    } | _routing_record(r)  # fmt: skip


def _routing_record(r: Result) -> dict[str, Any]:
    """Under ep: the run's routing the row was traced at, and the balanced plan."""
    if r.routing is None:
        return {}
    return {
        "routing": {"moe_imbalance": r.routing.mean, "moe_imbalance_layer_max": r.routing.peak},
        "traced_balanced": r.balanced,
    }


def _err(predicted: int | None, truth: int) -> str:
    return "-" if predicted is None else f"{(predicted - truth) / truth:+.1%}"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.2f} MiB"


def _row(r: dict[str, Any]) -> str:
    bound = r["analytic"] if r["analytic"] is not None else r["traced"]
    covered = "ok" if bound + r["spread"] >= r["worst"] * 0.995 else "BELOW"
    return (
        f"| {r['configuration']} | {r['world']} | {_mib(r['typical'])} | {_mib(r['worst'])} "
        f"| {_mib(r['analytic'])} | {_err(r['analytic'], r['typical'])} | "
        f"{_err(r['analytic'], r['worst'])} | {_mib(r['traced'])} | "
        f"{_err(r['traced'], r['typical'])} | {_err(r['traced'], r['worst'])} | {covered} "
        f"| {r['peak_at']} |"
    )


def _reruns(results: dict[str, Any]) -> list[str]:
    """The prose naming the rows a ``--merge`` run measured after the whole matrix."""
    return [
        f"Measured later and merged ({len(run['configurations'])} rows: "
        + ", ".join(f'"{n}"' for n in run["configurations"])
        + f") x {run['steps']} steps in {run['seconds']:.0f} s: "
        + results_io.provenance(run, NAME)
        for run in results.get("reruns", [])
    ]


def render(results: dict[str, Any]) -> str:
    """docs/planner.md's table and its worst errors (tests/unit/test_bench_docs.py)."""
    lines = [
        results_io.provenance(results, NAME),
        "",
        "| configuration | ranks | typical | worst | analytic | err | (worst) | traced | err "
        "| (worst) | bound | peak at |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
        *(_row(r) for r in results["rows"]),
    ]
    w = {k: "-" if v is None else f"{v:.1%}" for k, v in results["worst_error"].items()}
    rerun = {n for r in results.get("reruns", []) for n in r["configurations"]}
    lines += [
        "",
        f"{len(results['rows']) - len(rerun)} configurations x {results['steps']} steps in "
        f"{results['seconds']:.0f} s by the command above.",
        *(f"\n{line}" for line in _reruns(results)),
        "",
        f"Worst error over all {len(results['rows'])} rows vs the typical step: analytic "
        f"{w['analytic_typical']}, traced {w['traced_typical']} (target 3%); vs the "
        f"worst step: analytic {w['analytic_worst']}, traced {w['traced_worst']} "
        "(target 5%)." + _model_parallel_worst(results["rows"]),
        *_routed_rows(results["rows"]),
    ]
    return "\n".join(lines) + "\n"


def _routed_rows(records: list[dict[str, Any]]) -> list[str]:
    """The rows under expert parallelism: the routing their run recorded (the busiest
    rank's received / balanced rows, median step), and the traced plan's error against
    the typical step planned balanced (the default) and at that routing (the table's)."""
    routed = [r for r in records if r.get("routing")]
    if not routed:
        return []
    lines = [
        "",
        "Rows under expert parallelism, traced at the routing their own run recorded "
        "(`moe_imbalance`: the busiest ep rank's received rows over the MoE layers / "
        "balanced, `moe_imbalance_layer_max`: in its busiest layer; median step) and "
        "balanced (the plan's default):",
        "",
        "| configuration | ranks | moe_imbalance | layer max | balanced err | routed err |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in routed:
        imb = r["routing"]
        lines.append(
            f"| {r['configuration']} | {r['world']} | {imb['moe_imbalance']:.3f} "
            f"| {imb['moe_imbalance_layer_max']:.3f} "
            f"| {_err(r['traced_balanced'], r['typical'])} | {_err(r['traced'], r['typical'])} |"
        )
    return lines


def _model_parallel_worst(records: list[dict[str, Any]]) -> str:
    """The prose on the "MP" rows (parallel.tp / parallel.cp > 1, issue 23)."""
    mp = worst_errors([r for r in records if r["configuration"].startswith("MP ")])
    if mp["traced_typical"] is None or mp["analytic_typical"] is None:
        return ""
    return (
        ' The "MP" rows (tensor and context parallelism) are traced on the run\'s N-D '
        f"mesh of a fake process group: their worst traced error is {mp['traced_typical']:.2%}"
        f" vs the typical step, {mp['traced_worst']:.2%} vs the worst (analytic "
        f"{mp['analytic_typical']:.2%}, {mp['analytic_worst']:.2%})."
    )


def worst_errors(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """The largest |error| of each plan against the typical and the worst step, over
    the rows that have that plan (None: no row has it)."""

    def worst(plan: str, truth: str) -> float | None:
        errs = [abs(r[plan] - r[truth]) / r[truth] for r in records if r[plan] is not None]
        return max(errs, default=None)

    return {f"{p}_{t}": worst(p, t) for p in ("analytic", "traced") for t in ("typical", "worst")}


def merged(records: list[dict[str, Any]], *, steps: int, seconds: float) -> dict[str, Any]:
    """The results file with ``records`` measured now: they replace the rows of the same
    configuration and world (new rows join in matrix order), every other row keeps its
    record, and ``reruns`` gains this run's provenance (earlier reruns lose the rows
    measured again)."""
    if not results_io.path(NAME).is_file():
        raise SystemExit(
            f"--merge: {results_io.path(NAME)} does not exist, so there is nothing to merge "
            "into. Run the whole matrix first (`python bench/plan_accuracy.py`)."
        )
    old = results_io.read(NAME)
    new = {(r["configuration"], r["world"]): r for r in records}
    by_key = {(r["configuration"], r["world"]): r for r in old["rows"]} | new
    order = [(c.name, c.world) for c in CASES]
    keys = [k for k in order if k in by_key] + [k for k in by_key if k not in order]
    names = [r["configuration"] for r in records]
    reruns = [
        {**run, "configurations": [n for n in run["configurations"] if n not in names]}
        for run in old.get("reruns", [])
    ]
    this = {
        "command": "python " + shlex.join(sys.argv), "commit": results_io.commit(),
        "machine": results_io.machine(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()], "steps": steps,
        "seconds": round(seconds, 1), "configurations": names,
    }  # fmt: skip
    rows_ = [by_key[k] for k in keys]
    return {
        **old, "rows": rows_, "worst_error": worst_errors(rows_),
        "reruns": [r for r in reruns if r["configurations"]] + [this],
    }  # fmt: skip


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the tests' subset")
    parser.add_argument("--only", default="", help="rows whose name starts with this")
    parser.add_argument("--exact", action="store_true", help="--only names one row exactly")
    parser.add_argument("--merge", action="store_true", help="merge the rows into the file")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per row")
    parser.add_argument("--render-docs", action="store_true", help="only re-render the docs")
    args = parser.parse_args(argv)
    if args.render_docs:
        render_docs()
        return 0
    start = time.perf_counter()
    picked = (lambda n: n == args.only) if args.exact else (lambda n: n.startswith(args.only))
    cases = [c for c in (QUICK if args.quick else CASES) if picked(c.name)]
    records = [record(r) for r in rows(cases, steps=args.steps)]
    seconds = time.perf_counter() - start
    w = worst_errors(records)
    now = {"command": "(this run)", "commit": results_io.commit(), "machine": "", "date": ""}
    print(
        render({**now, "rows": records, "steps": args.steps, "seconds": seconds, "worst_error": w})
    )
    if cases == CASES:
        results_io.write(
            NAME, steps=args.steps, seconds=round(seconds, 1), worst_error=w, rows=records
        )
        render_docs()
    elif args.merge:
        results = merged(records, steps=args.steps, seconds=seconds)
        results_io.path(NAME).write_text(json.dumps(results, indent=1) + "\n")
        print(f"merged {len(records)} rows into {results_io.path(NAME)}")
        render_docs()
    typical = max(w[k] or 0.0 for k in ("analytic_typical", "traced_typical"))
    worst = max(w[k] or 0.0 for k in ("analytic_worst", "traced_worst"))
    return 0 if typical <= 0.03 and worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
