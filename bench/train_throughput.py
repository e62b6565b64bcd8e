"""Tokens/s of ``fsdpkit train`` vs a minimal hand-written FSDP2 loop (handwritten_loop.py).

    .venv/bin/python bench/train_throughput.py [--reps 4] [--steps 30]
    .venv/bin/python bench/train_throughput.py --render-docs   # BENCHMARKS.md from the results

Same model (tiny preset), data (built-in corpus), sequence length, batch, 2 CPU ranks,
hyper-parameters and LR schedule (fsdpkit's defaults). Rows: the hand-written loop
(A, and B: the same script again, the A/A control), ``fsdpkit train`` at the hand
loop's settings (fused AdamW, as the loop passes it; decay on matrices only, as
both do; full fp32 logits + cross-entropy: ``train.chunked_loss=off``) and ``fsdpkit
train`` at its own defaults (``optimizer_impl`` and ``chunked_loss`` auto: fused and
the chunked loss). Runs alternate in ABBA order so drift on a shared machine hits every
row alike. tokens/s over steps 3..N; ratio = row / hand-written A (median over median;
min-max of the per-repetition ratios); loss: the largest |loss - hand A's| over every
step (the same training: ~1e-6). Writes bench/results/train_throughput.json and
renders BENCHMARKS.md's train_throughput block.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import results_io
from peerlib.stats import abba, max_loss_diff, ratio

HERE = Path(__file__).parent
NAME = "train_throughput"
DOCS = results_io.ROOT / "BENCHMARKS.md"
FULL_LOSS = "full fp32 logits + F.cross_entropy"
# row -> (label, AdamW kernel, loss, fsdpkit train overrides or None for the hand loop)
ROWS: dict[str, tuple[str, str, str, list[str] | None]] = {
    "hand-A": ("hand-written FSDP2 loop (A)", "torch fused", FULL_LOSS, None),
    "kit": (
        "fsdpkit train at the loop's settings",
        "torch fused (train.optimizer_impl=fused)",
        FULL_LOSS + " (train.chunked_loss=off)",
        ["train.optimizer_impl=fused", "train.chunked_loss=off"],
    ),
    "kit-defaults": (
        "fsdpkit train, its defaults",
        "torch fused (train.optimizer_impl=auto)",
        "fsdpkit chunked CE (train.chunked_loss=auto: on)",
        [],
    ),
    "hand-B": ("hand-written FSDP2 loop (B = A: A/A control)", "torch fused", FULL_LOSS, None),
}
WORLD, SKIP = 2, 2


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _hand(*, steps: int, seq: int, batch: int, tmp: Path) -> dict[str, Any]:
    out = tmp / "hand.json"
    script = [str(HERE / "handwritten_loop.py"), str(steps), str(seq), str(batch), str(out)]
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(WORLD), *script, "fused"],
        check=True, capture_output=True, env=_env(),
    )  # fmt: skip
    return json.loads(out.read_text())


def _fsdpkit(
    *, steps: int, seq: int, batch: int, tmp: Path, tag: str, extra: list[str]
) -> dict[str, Any]:
    run_dir = tmp / f"kit-{tag}"
    subprocess.run(
        [sys.executable, "-m", "fsdpkit", "train", "--nproc", str(WORLD), f"train.steps={steps}",
         f"data.seq_len={seq}", f"train.micro_batch_size={batch}", "train.eval_every=0",
         "train.sample_tokens=0", "checkpoint.resume=never", "logging.progress=none",
         "logging.report=false", f"logging.run_dir={run_dir}", *extra],
        check=True, capture_output=True, env=_env(),
    )  # fmt: skip
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "loss" in r]
    return {"step_times": [r["step_time_s"] for r in steps_], "losses": [r["loss"] for r in steps_]}


def _run(key: str, args: argparse.Namespace, *, tmp: Path, rep: int) -> dict[str, Any]:
    shape = {"steps": args.steps, "seq": args.seq, "batch": args.batch, "tmp": tmp}
    extra = ROWS[key][3]
    if extra is None:
        return _hand(**shape)
    return _fsdpkit(**shape, tag=f"{key}-{rep}", extra=extra)


def measure(args: argparse.Namespace) -> tuple[dict[str, dict[str, list[Any]]], list[float]]:
    """{row: {"tokens_per_s", "losses", "wall_s"}} over ABBA repetitions, and the
    1-minute load average after each repetition."""
    out: dict[str, dict[str, list[Any]]] = {
        k: {"tokens_per_s": [], "losses": [], "wall_s": []} for k in ROWS
    }
    order, loads = abba(list(ROWS), args.reps), []
    with TemporaryDirectory(prefix="throughput-") as scratch:
        for i, (rep, key) in enumerate(order):
            t0 = time.monotonic()
            result = _run(key, args, tmp=Path(scratch), rep=rep)
            steady = result["step_times"][SKIP:]
            out[key]["tokens_per_s"].append(
                args.batch * args.seq * WORLD * len(steady) / sum(steady)
            )
            out[key]["losses"].append(result["losses"])
            out[key]["wall_s"].append(round(time.monotonic() - t0, 1))
            print(f"  rep {rep} {key}: {out[key]['tokens_per_s'][-1]:,.0f} tok/s", flush=True)
            if i + 1 == len(order) or order[i + 1][0] != rep:
                loads.append(round(os.getloadavg()[0], 2))
    return out, loads


def rows_of(measured: dict[str, dict[str, list[Any]]]) -> list[dict[str, Any]]:
    base = measured["hand-A"]
    rows = []
    for key, (label, kernel, loss, _) in ROWS.items():
        m = measured[key]
        rows.append({
            "key": key, "label": label, "adamw": kernel, "loss": loss,
            "tokens_per_s": [round(v, 1) for v in m["tokens_per_s"]],
            "median": statistics.median(m["tokens_per_s"]),
            "ratio": list(ratio(m["tokens_per_s"], base["tokens_per_s"])),
            "max_loss_diff": max_loss_diff(m["losses"], base["losses"][0]),
            "wall_s": m["wall_s"],
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--render-docs", action="store_true", help="only re-render BENCHMARKS.md")
    args = parser.parse_args()
    if not args.render_docs:
        t0 = time.monotonic()
        measured, loads = measure(args)
        results_io.write(
            NAME,
            command=f"python bench/train_throughput.py --reps {args.reps} --steps {args.steps} "
            f"--seq {args.seq} --batch {args.batch}",
            settings={"steps": args.steps, "seq": args.seq, "batch": args.batch, "world": WORLD,
                      "skip": SKIP, "reps": args.reps},
            minutes=round((time.monotonic() - t0) / 60, 2),
            load_1min_per_rep=loads,
            rows=rows_of(measured),
        )  # fmt: skip
        print(render(results_io.read(NAME)))
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(results: dict[str, Any]) -> str:
    """BENCHMARKS.md's train_throughput block (tests/unit/test_bench_docs.py checks it)."""
    s, loads = results["settings"], results["load_1min_per_rep"]
    lines = [
        results_io.provenance(results, NAME),
        "",
        f"tiny preset, seq {s['seq']}, micro-batch {s['batch']} per rank, {s['world']} gloo "
        f"ranks, fp32; {s['steps']} steps per run (tokens/s over steps {s['skip'] + 1}-"
        f"{s['steps']}), {s['reps']} alternating repetitions (ABBA), {results['minutes']:.1f} "
        f"min in all; 1-minute load average after each repetition {min(loads):.1f}-"
        f"{max(loads):.1f} on a shared 2-core machine. Every row: AdamW lr 3e-3, betas "
        "(0.9, 0.95), weight decay 0.1 on matrices only, 20 warm-up steps then cosine to "
        "0.1x, clipping at 1.0.",
        "",
        "| row | AdamW kernel | loss | tokens/s median | runs | vs hand-written A (paired "
        "min-max) | max abs loss diff vs A | s per launch (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        mid, low, high = r["ratio"]
        runs = ", ".join(f"{v:,.0f}" for v in r["tokens_per_s"])
        lines.append(
            f"| {r['label']} | {r['adamw']} | {r['loss']} | {r['median']:,.0f} | {runs} | "
            f"{_f(mid, '.3f')} ({_f(low, '.2f')}-{_f(high, '.2f')}) | "
            f"{_f(r['max_loss_diff'], '.1e')} | {statistics.median(r['wall_s']):.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
