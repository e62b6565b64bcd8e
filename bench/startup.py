"""How long the commands users run in a loop take to start, against ``import torch``.

    python bench/startup.py                 # 7 paired rounds
    python bench/startup.py --reps 11

Each round runs, in a fresh interpreter each and in a shuffled order, ``python -c
"import torch"`` twice (the baseline and a same-vs-same control) and every command
below once; a command's ratio is its wall time over the same round's baseline, and
the table gives the median ratio over the rounds (and the median seconds). One
unrecorded round first compiles the bytecode. The control row is the noise floor:
a ratio within its spread of 1.0 says nothing.

- ``fsdpkit --help``: the parser alone (no torch);
- ``fsdpkit version``: versions of fsdpkit, torch, transformers, peft;
- ``fsdpkit plan model.preset=llama3-405b --world-size 1024 --device-mem h100``: the
  analytic plan of a preset, the command a user reruns while choosing a layout
  (issue 40's target: at most 1.5x ``import torch``);
- ``fsdpkit ckpt inspect``: a checkpoint's summary (DCP's metadata classes).

Writes ``bench/results/startup.json`` and renders docs/planner.md's table from it
(``--render-docs`` only re-renders).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import results_io

NAME = "startup"
DOCS = results_io.ROOT / "docs" / "planner.md"
FIXTURE = results_io.ROOT / "tests" / "fixtures" / "checkpoints" / "tiny" / "checkpoints"
PLAN = ["plan", "model.preset=llama3-405b", "--world-size", "1024", "--device-mem", "h100"]


def commands() -> dict[str, list[str]]:
    """Row name -> argv (run with this interpreter)."""
    cli = [sys.executable, "-m", "fsdpkit"]
    step = sorted(FIXTURE.glob("step-*"))[-1]
    torch = [sys.executable, "-c", "import torch"]
    return {
        "import torch (baseline)": torch,
        "import torch (control)": torch,
        "fsdpkit --help": [*cli, "--help"],
        "fsdpkit version": [*cli, "version"],
        "fsdpkit plan (llama3-405b, 1024 ranks)": [*cli, *PLAN],
        "fsdpkit ckpt inspect": [*cli, "ckpt", "inspect", str(step)],
    }


def _seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def measure(reps: int, *, seed: int = 0) -> dict[str, list[float]]:
    """Row -> wall seconds per round (rounds in a shuffled order each)."""
    cmds = commands()
    for argv in cmds.values():  # compile bytecode, warm the page cache
        _seconds(argv)
    times: dict[str, list[float]] = {name: [] for name in cmds}
    order = list(cmds)
    rng = random.Random(seed)
    for _ in range(reps):
        rng.shuffle(order)
        for name in order:
            times[name].append(_seconds(cmds[name]))
    return times


def rows(times: dict[str, list[float]]) -> list[dict[str, Any]]:
    base = times["import torch (baseline)"]
    out = []
    for name, values in times.items():
        if name == "import torch (baseline)":
            continue
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        out.append(
            {
                "command": name,
                "median_s": round(statistics.median(values), 3),
                "ratio": round(statistics.median(ratios), 2),
                "ratio_min": round(min(ratios), 2),
                "ratio_max": round(max(ratios), 2),
            }
        )
    return out


def render(results: dict[str, Any]) -> str:
    """docs/planner.md's table (tests/unit/test_bench_docs.py checks it)."""
    lines = [
        results_io.provenance(results, NAME),
        "",
        f"{results['reps']} paired rounds, shuffled order, median; `import torch` took "
        f"{results['baseline_s']:.2f} s (median).",
        "",
        "| command | s | vs `import torch` | rounds |",
        "| --- | ---: | ---: | --- |",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['command']} | {r['median_s']:.2f} | {r['ratio']:.2f}x | "
            f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="paired rounds")
    parser.add_argument(
        "--render-docs", action="store_true", help="only re-render docs/planner.md's table"
    )
    args = parser.parse_args(argv)
    if args.render_docs:
        render_docs()
        return 0
    times = measure(args.reps)
    table = rows(times)
    print(f"start-up vs `import torch`, {args.reps} paired rounds, median")
    for r in table:
        print(f"  {r['command']:42} {r['median_s']:6.2f} s  {r['ratio']:.2f}x")
    results_io.write(
        NAME,
        reps=args.reps,
        baseline_s=round(statistics.median(times["import torch (baseline)"]), 3),
        python=sys.version.split()[0],
        rows=table,
    )
    render_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
