"""docs/runtime.md's "SLURM, tested" table, from the tests that ran each scenario.

    .venv/bin/python bench/slurm_scenarios.py                 # as root: runs tests/slurm
    .venv/bin/python bench/slurm_scenarios.py --repeat 10     # each requeue scenario 10x
    .venv/bin/python bench/slurm_scenarios.py --render-docs   # only re-render the docs

Runs ``pytest tests/slurm`` (a real cluster: munge, slurmctld and two slurmds in
network namespaces, tests/slurmcluster.py) with ``FSDPKIT_SLURM_RESULTS`` set:
every scenario records what happened and how long it took, through real ``sbatch``.
Writes bench/results/slurm_scenarios.json with pytest's pass/fail counts beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import results_io

NAME = "slurm_scenarios"
DOCS = results_io.ROOT / "docs" / "runtime.md"


def run(repeat: int) -> dict[str, Any]:
    """Run the tests; their rows and pytest's summary line."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "FSDPKIT_SLURM_RESULTS": str(out), "FSDPKIT_SLURM_REPEAT": str(repeat)}
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/slurm"],
            cwd=results_io.ROOT, env=env, capture_output=True, text=True,
        )  # fmt: skip
        print(done.stdout[-3000:], done.stderr[-2000:])
        rows = json.loads(out.read_text()) if out.exists() else []
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "no output"
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    return {"rows": rows, "pytest": summary, "counts": counts, "repeat": repeat}


def _table(rows: list[dict[str, str]], *, repeat: int) -> str:
    """One line per scenario (its first run); a repeated one says how many runs passed
    (a run that failed records no row)."""
    lines = ["| scenario | what happens | how long | command |", "| --- | --- | --- | --- |"]
    runs: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        runs.setdefault(row["scenario"], []).append(row)
    for name, mine in runs.items():
        row = mine[0]
        passed = f" ({len(mine)} of {repeat} runs passed)" if len(mine) > 1 else ""
        lines.append(f"| {name} | {row['happens']} | {_spans(mine)}{passed} | "
                     f"`{row['command']}` |")  # fmt: skip
    return "\n".join(lines)


def _spans(rows: list[dict[str, str]]) -> str:
    """The first run's "how long" with each of its numbers as the span over all runs
    (``saved 0.5-2.1 s ...``)."""
    number = re.compile(r"\d+\.\d+")
    columns = list(zip(*(map(float, number.findall(r["seconds"])) for r in rows), strict=True))
    spans = iter(f"{min(c):.1f}" if min(c) == max(c) else f"{min(c):.1f}-{max(c):.1f}"
                 for c in columns)  # fmt: skip
    return number.sub(lambda _: next(spans), rows[0]["seconds"])


def render(results: dict[str, Any]) -> str:
    """The table and where it came from (tests/unit/test_bench_docs.py checks it)."""
    counts, repeat = results["counts"], results["repeat"]
    runs = f", each requeue scenario run {repeat} times" if repeat > 1 else ""
    head = (
        results_io.provenance(results, NAME)
        + f" pytest: {counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed{runs}"
        + "; times from a machine other jobs were loading."
    )
    return head + "\n\n" + _table(results["rows"], repeat=repeat) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each requeue scenario")
    parser.add_argument("--render-docs", action="store_true", help="only re-render the docs")
    args = parser.parse_args()
    if not args.render_docs:
        results_io.write(NAME, **run(args.repeat))
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


if __name__ == "__main__":
    main()
