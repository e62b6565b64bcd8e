"""fsdpkit against the frameworks a user would pick instead, on the same work.

    make venv && .venv/bin/pip install -e '.[bench]' -c <(echo torch==2.13.0)
    .venv/bin/python bench/peers.py                    # defaults: < 15 min on 2 CPU cores
    .venv/bin/python bench/peers.py --reps 8 --out bench-out --rows fsdpkit-train,ddp

Same model (tiny Llama preset, fsdpkit's deterministic weights), same per-rank batches
(fsdpkit's packed loader), same global batch, fp32, full sharding with every block its
own unit, same AdamW (decay on matrices only) and clipping, constant LR, same number of
steps, 2 gloo ranks x 1 thread. Rows run in alternating order (ABBA) for ``--reps``
repetitions in this one invocation; "hand-written FSDP2 A/B" is the same script twice,
so its ratio is the noise floor. Each row: tokens/s over steps 3..N-1 (median, min-max),
the ratio to ``fsdpkit train`` (median over median; min-max of the per-repetition
ratios), the peak of live tensor memory per rank during step N (c10's process-wide
allocator count), the parameter share each rank holds (1/N = sharded), and the largest
loss difference from DDP (the unsharded reference) over every step: above 1e-5 the row
is WRONG. Then: what Accelerate, Lightning and torchtitan do on CPU as shipped (probes),
and per-rank memory at world size 1, 2, 4 per strategy with a plot (peers_memory.png).
Results (raw JSON, logs, plot) go to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peerlib import scaling
from peerlib.common import Spec
from peerlib.launch import LaunchFailed, run_ranks
from peerlib.stats import Runs, Summary, abba, summarize

BASELINE, REFERENCE = "fsdpkit-train", "ddp"
# row -> (implementation module or None for the CLI, the package it needs, label)
ROWS: dict[str, tuple[str | None, str | None, str]] = {
    "hand-A": ("impl_hand", None, "hand-written FSDP2 (A)"),
    "hand-B": ("impl_hand", None, "hand-written FSDP2 (B, same script)"),
    "fsdpkit-train": (None, None, "fsdpkit train (CLI)"),
    "fsdpkit-api": ("impl_fsdpkit_api", None, "fsdpkit library API"),
    "accelerate": ("impl_accelerate", "accelerate", "Accelerate FSDP2 plugin*"),
    "fabric": ("impl_fabric", "lightning", "Lightning Fabric FSDP2"),
    "deepspeed": ("impl_deepspeed", "deepspeed", "DeepSpeed ZeRO-3"),
    "ddp": ("impl_ddp", None, "DDP (unsharded reference)"),
}
WORLD = 2


def _kit_train(spec: Spec, *, tmp: Path, tag: str) -> dict[str, Any]:
    """``fsdpkit train`` as a user runs it, set to the spec; step N profiled for memory."""
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
        f"logging.run_dir={run_dir}",
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


def _one(row: str, spec: Spec, *, tmp: Path, rep: int) -> dict[str, Any]:
    module, _, _ = ROWS[row]
    tag = f"{row}-{rep}"
    if module is None:
        return _kit_train(spec, tmp=tmp, tag=tag)
    out = tmp / f"{tag}.json"
    run_ranks(
        ["-m", f"peerlib.{module}"],
        nproc=WORLD,
        spec=replace(spec, out=str(out)),
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


def measure_rows(rows: list[str], spec: Spec, *, reps: int, tmp: Path) -> dict[str, Runs]:
    runs = {r: Runs() for r in rows}
    for rep, row in abba(rows, reps):
        if runs[row].error:
            continue
        t0 = time.monotonic()
        try:
            result = _one(row, spec, tmp=tmp, rep=rep)
        except LaunchFailed as exc:
            runs[row].error = _error_line(exc)
            print(f"  rep {rep} {row}: FAILED {runs[row].error}", flush=True)
            continue
        r = runs[row]
        r.tokens_per_s.append(_tokens_per_s(result))
        r.losses.append(result["losses"])
        r.peak_mib = [b / 2**20 for b in result["peak_bytes_per_rank"]]
        r.shard_fraction = result.get("shard_fraction")
        r.note = result.get("note", "")
        took = time.monotonic() - t0
        print(f"  rep {rep} {row}: {r.tokens_per_s[-1]:,.0f} tok/s ({took:.0f}s)", flush=True)
    return runs


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(summaries: list[Summary], runs: dict[str, Runs]) -> str:
    head = (
        f"| {'implementation':<36} | tokens/s median | min-max | vs fsdpkit train (paired "
        "min-max) | peak MiB/rank | params/rank | max abs loss diff vs DDP | verdict |"
    )
    lines = [head, "|" + "---|" * 8]
    for s in summaries:
        r = runs[s.name]
        share = f"1/{round(1 / r.shard_fraction)}" if r.shard_fraction else "-"
        lines.append(
            f"| {ROWS[s.name][2]:<36} | {_f(s.median, ',.0f')} | "
            f"{_f(s.low, ',.0f')}-{_f(s.high, ',.0f')} | {_f(s.ratio, '.3f')} "
            f"({_f(s.ratio_low, '.2f')}-{_f(s.ratio_high, '.2f')}) | "
            f"{' / '.join(f'{m:.1f}' for m in r.peak_mib) or '-'} | {share} | "
            f"{_f(s.max_loss_diff, '.1e')} | {s.verdict} |"
        )
    return "\n".join(lines)


def _control(summaries: list[Summary]) -> str:
    by = {s.name: s for s in summaries}
    a, b = by.get("hand-A"), by.get("hand-B")
    if not (a and b and a.median and b.median):
        return ""
    return f"A/A control: hand-written B / A = {b.median / a.median:.3f} (noise floor)"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names")
    parser.add_argument("--out", type=Path, default=None, help="keep logs, JSON and the plot")
    parser.add_argument("--no-probes", action="store_true")
    parser.add_argument("--no-scaling", action="store_true")
    args = parser.parse_args()
    spec = Spec(steps=args.steps)
    rows = [r for r in args.rows.split(",") if r]
    missing = [r for r in rows if ROWS[r][1] and importlib.util.find_spec(ROWS[r][1]) is None]
    with tempfile.TemporaryDirectory(prefix="peers-") as scratch:
        tmp = args.out or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        print(f"{len(rows)} rows x {args.reps} alternating repetitions; spec {asdict(spec)}")
        runs = measure_rows([r for r in rows if r not in missing], spec, reps=args.reps, tmp=tmp)
        for r in missing:
            runs[r] = Runs(error=f"{ROWS[r][1]} not installed (pip install -e '.[bench]')")
        summaries = summarize(runs, baseline=BASELINE, reference=REFERENCE)
        found = {} if args.no_probes else probes(tmp)
        scale = None
        if not args.no_scaling:
            scale = scaling.measure(
                worlds=(1, 2, 4), seq_len=spec.seq_len, micro_batch=spec.micro_batch
            )
            scaling.plot(scale, tmp / "peers_memory.png")
        report(summaries, runs, found, scale, tmp=tmp, seconds=time.monotonic() - t0)


def report(summaries: list[Summary], runs: dict[str, Runs], found: dict[str, Any],
           scale: dict[int, Any] | None, *, tmp: Path, seconds: float) -> None:  # fmt: skip
    print()
    print(format_table(summaries, runs))
    print(_control(summaries))
    notes = {ROWS[n][2]: r.note for n, r in runs.items() if r.note}
    for label, note in notes.items():
        print(f"  {label}: {note}")
    for name, seen in found.items():
        print(f"probe {name}: {json.dumps(seen)}")
    if scale is not None:
        print()
        print(format_scaling(scale))
        print(f"plot: {tmp / 'peers_memory.png'}")
    raw = {n: asdict(r) for n, r in runs.items()}
    (tmp / "results.json").write_text(json.dumps({"rows": raw, "probes": found, "scaling": scale}))
    print(f"total {seconds / 60:.1f} min; raw results in {tmp / 'results.json'}")


def format_scaling(scale: dict[int, Any]) -> str:
    worlds = sorted(scale)
    head = (
        "| strategy | "
        + " | ".join(f"N={w} state / peak MiB" for w in worlds)
        + " | state x N (ideal: constant) |"
    )
    lines = [head, "|" + "---|" * (len(worlds) + 2)]
    for strategy in scaling.STRATEGIES:
        cells = []
        for w in worlds:
            ranks = scale[w]
            state = max(r[strategy]["model_state"] for r in ranks) / 2**20
            peak = max(r[strategy]["peak"] for r in ranks) / 2**20
            cells.append(f"{state:.1f} / {peak:.1f}")
        ideal = " / ".join(
            f"{max(r[strategy]['model_state'] for r in scale[w]) * w / 2**20:.1f}" for w in worlds
        )
        lines.append(f"| {strategy} | " + " | ".join(cells) + f" | {ideal} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
