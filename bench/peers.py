"""fsdpkit against the frameworks a user would pick instead, on the same work.

    make venv && .venv/bin/pip install -e '.[bench]' -c <(echo torch==2.13.0)
    .venv/bin/python bench/peers.py                    # defaults: ~15 min on 2 CPU cores
    .venv/bin/python bench/peers.py --reps 2 --out bench-out --rows hand-A,fsdpkit-train,hand-B
    .venv/bin/python bench/peers.py --render-docs      # BENCHMARKS.md from the results file

Same model (tiny Llama preset, fsdpkit's deterministic weights), same per-rank batches
(fsdpkit's packed loader), same global batch, fp32, full sharding with every block its
own unit, AdamW with decay on matrices only, clipping, constant LR, same number of
steps, 2 gloo ranks x 1 thread. Two groups of rows (peerlib/rows.py): at the **shared
settings** every row steps the same torch AdamW kernel (fused, passed explicitly) and
the full-logits loss; at the **defaults** each framework steps what it picks itself
(fsdpkit train: fused AdamW and its chunked loss; torch AdamW's own kernel, for-loop
on CPU, which the hand-written loop, Accelerate, Fabric and DDP all pass through;
DeepSpeed's own AdamW). Rows run in alternating order (ABBA) for ``--reps``
repetitions in this one invocation; "hand-written FSDP2 B" is the A script again, so
B/A is the noise floor. Each row: tokens/s over steps 3..N-1 (median, min-max), the
ratio to hand-written A (median over median; min-max of the per-repetition ratios),
defaults rows also to their own framework at the shared settings, the peak of live
tensor memory per rank during step N (c10's process-wide allocator count), the
parameter share each rank holds (1/N = sharded), the largest loss difference from DDP
(the unsharded reference) over every step (above 1e-5 the row is WRONG), and the wall
seconds of a launch. Then what Accelerate, Lightning and torchtitan do on CPU as
shipped (probes), and per-rank memory at world size 1, 2, 4 per strategy. Writes
bench/results/peers.json (results_io) and renders BENCHMARKS.md's peers block; logs and
the memory plot go to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io
from peerlib import scaling, tables
from peerlib.common import Spec
from peerlib.launch import LaunchFailed, run_ranks
from peerlib.rows import BASELINE, CONTROL, REFERENCE, ROWS, cli_adamw
from peerlib.stats import Runs, Summary, abba, ratio, summarize

NAME = "peers"
DOCS = results_io.ROOT / "BENCHMARKS.md"
WORLD = 2


def _kit_train(spec: Spec, *, extra: tuple[str, ...], tmp: Path, tag: str) -> dict[str, Any]:
    """``fsdpkit train`` as a user runs it, set to the spec and the row's ``extra``
    overrides; step N profiled for memory."""
    run_dir = tmp / f"kit-{tag}"
    overrides = [
        f"model.preset={spec.preset}", f"data.seq_len={spec.seq_len}",
        f"data.max_bytes={spec.max_bytes}", f"train.micro_batch_size={spec.micro_batch}",
        f"train.steps={spec.steps}", f"train.seed={spec.seed}", f"train.lr={spec.lr}",
        f"train.beta1={spec.beta1}", f"train.beta2={spec.beta2}",
        f"train.weight_decay={spec.weight_decay}", f"train.grad_clip={spec.grad_clip}",
        "train.schedule=constant", "train.warmup_steps=0", "train.eval_every=0",
        "train.sample_tokens=0", "precision.mode=fp32", "parallel.strategy=full",
        "checkpoint.resume=never", "logging.progress=none", "logging.report=false",
        f"logging.profile_steps=[{spec.memory_step},{spec.memory_step}]",
        f"logging.run_dir={run_dir}", *extra,
    ]  # fmt: skip
    argv = ["-m", "fsdpkit", "train", "--nproc", str(WORLD), *overrides]
    run_ranks(argv, nproc=0, spec=None, log=tmp / f"kit-{tag}.log", timeout_s=600)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    breakdown = json.loads((run_dir / "profile" / "breakdown.json").read_text())
    return {
        "losses": [r["loss"] for r in steps],
        "step_times": [r["step_time_s"] for r in steps],
        "timed_steps": list(range(spec.warmup + 1, spec.memory_step)),
        "tokens_per_step": spec.micro_batch * spec.seq_len * WORLD,
        "peak_bytes_per_rank": [b["peak_tensor_mib"] * 2**20 for b in breakdown],
        "shard_fraction": 1 / WORLD,
    }


def _one(key: str, spec: Spec, *, tmp: Path, rep: int) -> dict[str, Any]:
    row, tag = ROWS[key], f"{key}-{rep}"
    if row.module is None:
        return {**_kit_train(spec, extra=row.cli, tmp=tmp, tag=tag), "adamw": cli_adamw(row)}
    out = tmp / f"{tag}.json"
    run_ranks(
        ["-m", f"peerlib.{row.module}"],
        nproc=WORLD,
        spec=replace(spec, out=str(out), adamw=row.adamw),
        log=tmp / f"{tag}.log",
        timeout_s=600,
    )
    return json.loads(out.read_text())


def _tokens_per_s(result: dict[str, Any]) -> float:
    times = [result["step_times"][s - 1] for s in result["timed_steps"]]
    return result["tokens_per_step"] * len(times) / sum(times)


def _error_line(exc: LaunchFailed) -> str:
    lines = [x for x in str(exc).splitlines() if re.match(r"^\w*(Error|Exception)\b", x)]
    return (lines[-1] if lines else str(exc).splitlines()[0])[:300]


def measure_rows(
    rows: list[str], spec: Spec, *, reps: int, tmp: Path
) -> tuple[dict[str, Runs], list[float]]:
    """Every row ``reps`` times in ABBA order; also the 1-minute load average after
    each repetition."""
    runs, loads = {r: Runs() for r in rows}, []
    order = abba(rows, reps)
    for i, (rep, key) in enumerate(order):
        if not runs[key].error:
            _measure_one(key, spec, runs=runs[key], tmp=tmp, rep=rep)
        if i + 1 == len(order) or order[i + 1][0] != rep:
            loads.append(round(os.getloadavg()[0], 2))
            print(f"  after repetition {rep}: load {loads[-1]}", flush=True)
    return runs, loads


def _measure_one(key: str, spec: Spec, *, runs: Runs, tmp: Path, rep: int) -> None:
    t0 = time.monotonic()
    try:
        result = _one(key, spec, tmp=tmp, rep=rep)
    except LaunchFailed as exc:
        runs.error = _error_line(exc)
        print(f"  rep {rep} {key}: FAILED {runs.error}", flush=True)
        return
    runs.tokens_per_s.append(_tokens_per_s(result))
    runs.losses.append(result["losses"])
    runs.peak_mib = [b / 2**20 for b in result["peak_bytes_per_rank"]]
    runs.shard_fraction = result.get("shard_fraction")
    runs.note = result.get("note", "")
    runs.adamw = result.get("adamw", "")
    runs.wall_s.append(round(time.monotonic() - t0, 1))
    print(
        f"  rep {rep} {key}: {runs.tokens_per_s[-1]:,.0f} tok/s ({runs.wall_s[-1]:.0f}s)",
        flush=True,
    )


def row_record(s: Summary, runs: dict[str, Runs]) -> dict[str, Any]:
    """One row of the results file: its settings as built, and what it measured."""
    row, r = ROWS[s.name], runs[s.name]
    twin = runs.get(row.shared_twin or "")
    return {
        "key": s.name,
        "label": row.label,
        "defaults": row.defaults,
        "adamw": r.adamw,
        "loss": row.loss,
        "units": row.units,
        "tokens_per_s": [round(v, 1) for v in r.tokens_per_s],
        "median": s.median,
        "low": s.low,
        "high": s.high,
        "ratio": [s.ratio, s.ratio_low, s.ratio_high],
        "vs_shared": list(ratio(r.tokens_per_s, twin.tokens_per_s)) if twin else None,
        "peak_mib": [round(m, 2) for m in r.peak_mib],
        "shard_fraction": r.shard_fraction,
        "max_loss_diff": s.max_loss_diff,
        "verdict": s.verdict,
        "note": r.note,
        "wall_s": r.wall_s,
    }


def probes(tmp: Path) -> dict[str, Any]:
    """What each peer does on CPU as shipped."""
    out: dict[str, Any] = {}
    for name, package in (("accelerate", "accelerate"), ("fabric", "lightning")):
        if importlib.util.find_spec(package) is None:
            out[name] = "not installed (pip install -e '.[bench]')"
            continue
        path = tmp / f"probe-{name}.json"
        try:
            run_ranks(["-m", f"peerlib.probe_{name}"], nproc=WORLD, spec=None,
                      log=tmp / f"probe-{name}.log", timeout_s=300,
                      extra_env={"PEERS_PROBE_OUT": str(path)})  # fmt: skip
            out[name] = json.loads(path.read_text())
        except LaunchFailed as exc:
            out[name] = f"probe failed: {_error_line(exc)}"
    out["torchtitan"] = _torchtitan(tmp)
    return out


def _torchtitan(tmp: Path) -> str:
    """torchtitan's own trainer on 2 CPU ranks with its debug model: the error it stops with."""
    if importlib.util.find_spec("torchtitan") is None:
        return "not installed (pip install -e '.[bench]')"
    argv = ["-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel",
            "--training.steps", "3", "--training.seq_len", "128",
            "--training.local_batch_size", "4"]  # fmt: skip
    try:
        run_ranks(argv, nproc=WORLD, spec=None, log=tmp / "torchtitan.log", timeout_s=300)
    except LaunchFailed as exc:
        return f"cannot run on CPU: {_error_line(exc)}"
    return "ran (unexpected on CPU: compare it by hand)"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names")
    parser.add_argument("--out", type=Path, default=None, help="keep logs, JSON and the plot")
    parser.add_argument("--no-probes", action="store_true")
    parser.add_argument("--no-scaling", action="store_true")
    parser.add_argument("--render-docs", action="store_true", help="only re-render BENCHMARKS.md")
    return parser.parse_args()


def main() -> None:
    args = _args()
    if args.render_docs:
        render_docs()
        return
    spec = Spec(steps=args.steps)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        sys.exit(f"--rows: unknown row(s) {unknown}; the rows are {', '.join(ROWS)}")
    missing = [
        r for r in rows if ROWS[r].package and importlib.util.find_spec(ROWS[r].package) is None
    ]
    with tempfile.TemporaryDirectory(prefix="peers-") as scratch:
        tmp = args.out or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        print(f"{len(rows)} rows x {args.reps} alternating repetitions; spec {asdict(spec)}")
        live = [r for r in rows if r not in missing]
        runs, loads = measure_rows(live, spec, reps=args.reps, tmp=tmp)
        for r in missing:
            runs[r] = Runs(error=f"{ROWS[r].package} not installed (pip install -e '.[bench]')")
        summaries = summarize({r: runs[r] for r in rows}, baseline=BASELINE, reference=REFERENCE)
        found = {} if args.no_probes else probes(tmp)
        scale = None
        if not args.no_scaling:
            scale = scaling.measure(
                worlds=(1, 2, 4), seq_len=spec.seq_len, micro_batch=spec.micro_batch
            )
            scaling.plot(scale, tmp / "peers_memory.png")
        spec_record = {k: v for k, v in asdict(spec).items() if k not in ("out", "adamw")}
        results_io.write(
            NAME,
            command=f"python bench/peers.py --reps {args.reps} --steps {args.steps}"
            + ("" if args.rows == ",".join(ROWS) else f" --rows {args.rows}"),
            spec=spec_record,
            reps=args.reps,
            world=WORLD,
            control=CONTROL,
            minutes=round((time.monotonic() - t0) / 60, 2),
            load_1min_per_rep=loads,
            rows=[row_record(s, runs) for s in summaries],
            probes=found,
            scaling=scale,
        )
    print(render(results_io.read(NAME)))
    render_docs()


def render(results: dict[str, Any]) -> str:
    """BENCHMARKS.md's peers block (tests/unit/test_bench_docs.py checks it)."""
    return tables.render(results, provenance=results_io.provenance(results, NAME))


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


if __name__ == "__main__":
    main()
