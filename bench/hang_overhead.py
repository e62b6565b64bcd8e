"""What hang triage costs a run that never hangs: phase marks, the flight recorder, a step.

    .venv/bin/python bench/hang_overhead.py [--reps 4] [--steps 30]
    .venv/bin/python bench/hang_overhead.py --render-docs    # only re-render the docs

1. marks: ``HangProbe`` phase marks in this process (anonymous record and the
   launcher's file-backed one), per mark and per step (2 x micro-batches + 5 marks).
2. flight recorder: gloo all-reduces of 1 KiB on a one-rank group (a real
   ProcessGroupGloo, no network, so the recorder's share is visible), separate
   processes alternating recorder off / on (``TORCH_FR_BUFFER_SIZE`` is read once
   per process); per collective.
3. training: ``fsdpkit train`` on the tests' tiny model, 2 ranks, alternating recorder
   on (the default) / off, plus a same-vs-same control pair; median step time of
   steps 3..N from metrics.jsonl. Expect noise of +-10% on a shared machine: rows
   1-2 are the precise numbers, row 3 shows nothing larger hides in a real run.

Writes bench/results/hang_overhead.json and renders docs/runtime.md's table from it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import results_io

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from clirun import FAST, cli_env  # noqa: E402

from fsdpkit.runtime.hangs import HangProbe  # noqa: E402
from fsdpkit.runtime.hangs.record import Record  # noqa: E402

COLLECTIVE = """
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
t = torch.ones(256)
for _ in range(500):
    dist.all_reduce(t)
n = int(sys.argv[2]); t0 = time.perf_counter()
for _ in range(n):
    dist.all_reduce(t)
print((time.perf_counter() - t0) / n * 1e6)
dist.destroy_process_group()
"""


def marks() -> list[tuple[str, float]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, record in [
            ("anonymous record", Record.create(None, rank=0)),
            ("file-backed record", Record.create(Path(tmp) / "progress-rank-0", rank=0)),
        ]:
            probe = HangProbe(record, rank=0, run_dir=None, control=None, stall_s=0)
            n = 200_000
            per = timeit.timeit(lambda p=probe: p.phase("data"), number=n) / n * 1e6
            rows.append((f"phase mark, {name}", per))
            step = timeit.timeit(lambda p=probe: _one_step(p, 2), number=n // 10) / (n // 10)
            rows.append((f"all marks of a 2-micro-batch step, {name}", step * 1e6))
            record.close()
    return rows


def _one_step(probe: HangProbe, micro: int) -> None:
    probe.phase("data")
    mark = probe.marker(micro)
    for _ in range(micro):
        mark("forward")
        mark("backward")
    mark("optimizer step")
    probe.step_done(1)
    probe.phase("eval")
    probe.phase("checkpoint")


def recorder(reps: int, n: int = 20_000) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(reps):
        for label, size in (("off", "0"), ("on", "2000"), ("on", "2000"), ("off", "0")):
            with tempfile.TemporaryDirectory() as tmp:
                env = {**os.environ, "TORCH_FR_BUFFER_SIZE": size}
                args = [sys.executable, "-c", COLLECTIVE, f"{tmp}/store", str(n)]
                text = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
                out[label].append(float(text.stdout.strip().splitlines()[-1]))
    return out


def _train(size: str, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        args = [a for a in FAST if not a.startswith(("train.steps", "train.eval_every"))]
        args += [f"train.steps={steps}", "train.eval_every=0", "logging.progress=none"]
        env = cli_env({"TORCH_FR_BUFFER_SIZE": size})
        cmd = [sys.executable, "-m", "fsdpkit", "train", *args, f"logging.run_dir={run_dir}"]
        subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, check=True, timeout=600)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        times = [r["step_time_s"] for r in map(json.loads, lines) if "step_time_s" in r]
        return statistics.median(times[2:])


def training(reps: int, steps: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"on": [], "off": [], "on (control)": []}
    for _ in range(reps):
        for label, size in (("on", "2000"), ("off", "0"), ("on (control)", "2000")):
            out[label].append(_train(size, steps))
    return out


NAME = "hang_overhead"
DOCS = results_io.ROOT / "docs" / "runtime.md"


def measure(reps: int, steps: int) -> dict[str, Any]:
    """Every figure of the table: marks (us), the recorder's all-reduce (us per
    collective, each process), the training steps (s, each run)."""
    fr = recorder(reps)
    return {
        "reps": reps,
        "steps": steps,
        "marks_us": [{"what": name, "us": round(us, 3)} for name, us in marks()],
        "allreduce_us": {k: [round(v, 2) for v in vs] for k, vs in fr.items()},
        "train_step_s": {k: [round(v, 5) for v in vs] for k, vs in training(reps, steps).items()},
    }


def render(results: dict[str, Any]) -> str:
    """docs/runtime.md's table (tests/unit/test_bench_docs.py checks it)."""
    fr, tr = results["allreduce_us"], results["train_step_s"]
    off, on = statistics.median(fr["off"]), statistics.median(fr["on"])
    base = statistics.median(tr["off"])
    lines = [
        results_io.provenance(results, NAME),
        "",
        f"{results['reps']} rounds; the all-reduce: median of {len(fr['off'])} processes per "
        f"side; the train step: median of steps 3-{results['steps']} per run, median of "
        f"{len(tr['off'])} runs per row.",
        "",
        "| measurement | value |",
        "| --- | --- |",
    ]
    lines += [f"| {m['what']} | {m['us']:.2f} us |" for m in results["marks_us"]]
    lines.append(
        f"| gloo all-reduce of 1 KiB on a one-rank group, recorder off / on (per-process "
        f"min-max {min(fr['off']):.1f}-{max(fr['off']):.1f} / {min(fr['on']):.1f}-"
        f"{max(fr['on']):.1f} us) | {off:.1f} / {on:.1f} us ({on - off:+.1f} us per collective) |"
    )
    for label, values in tr.items():
        med = statistics.median(values)
        runs = ", ".join(f"{v * 1e3:.1f}" for v in values)
        lines.append(
            f"| `fsdpkit train`, tests' tiny Llama, step with the recorder {label} (runs: "
            f"{runs} ms) | {med * 1e3:.1f} ms ({med / base:.3f} x off) |"
        )
    return "\n".join(lines) + "\n"


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--render-docs", action="store_true", help="only re-render the docs")
    a = p.parse_args()
    if not a.render_docs:
        t0 = time.perf_counter()
        results = measure(a.reps, a.steps)
        results_io.write(NAME, seconds=round(time.perf_counter() - t0), **results)
        print(render(results_io.read(NAME)))
    render_docs()


if __name__ == "__main__":
    main()
