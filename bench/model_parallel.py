"""Tensor, sequence and context parallelism next to FSDP only: tokens/s and per-rank
memory of the same training at 4 CPU ranks (gloo), one row per layout.

    .venv/bin/python bench/model_parallel.py                 # 3 rounds, ~12 min at load ~10
    .venv/bin/python bench/model_parallel.py --quick         # 1 round, 4 steps (a smoke run)
    .venv/bin/python bench/model_parallel.py --render-docs docs/parallelism.md

Rows (every setting but the layout identical: the built-in Llama at dim 256, 4 blocks,
8 query / 4 key-value heads, seq 1024, fp32, chunked loss (the default), global batch 4
sequences per step with a per-rank micro-batch cap of 2, the built-in corpus):

- FSDP only: ``parallel.tp=1 parallel.cp=1`` (4 data ranks, 1 sequence each);
- dp2 x tp2: ``parallel.tp=2`` (Megatron pairs + sequence parallelism);
- dp2 x cp2: ``parallel.cp=2`` (Ulysses all-to-all; each rank half of every sequence);
- dp2 x cp2 ring: ``parallel.cp=2 parallel.cp_attention=ring`` (torch's ring attention
  over the CPU flash kernel; each rank two head-tail quarters of every sequence);
- tp2 x cp2: ``parallel.tp=2 parallel.cp=2`` (1 data rank: 2 micro-batches of 2);
- FSDP only again: the A/A control.

``--pp`` (or ``bench/model_parallel_pp.py``) runs the pipeline rows of issue 38 instead
(bench/results/model_parallel_pp.json,
the same model untied, micro-batches of 1 sequence): FSDP only; pp2 x dp2 with 1F1B and
with Interleaved1F1B (2 stages per rank); pp4 (1F1B, 4 micro-batches); pp2 x tp2; FSDP
only again (the A/A control).

Each run goes through the library's own build path (``fsdpkit.run.resolve`` ->
``build_session`` -> the training loop, what ``fsdpkit train`` runs in each worker) on
4 spawned gloo ranks, so the bench can read each rank's resident set right after the
build (model, optimizer, data mapped; before the first step) beside the run's peak
(``ru_maxrss``, the figure metrics.jsonl reports): "step part" = peak - after build,
what a training step adds (activations, gradients, optimizer state, gloo buffers).
Rounds run the rows in order (A B C D E A', A B C D E A', ...); tokens/s is the loop's own
(global batch x seq / step time) over steps 3..N; ratios are median over median vs
FSDP only, with the min-max of per-round ratios. The loss column is the largest
|loss - FSDP only's| over every step: the layouts train the same math. The corpus is
prepared once into a shared cache before the first round. Writes
bench/results/model_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import results_io
from peerlib.stats import ratio

NAME, PP_NAME = "model_parallel", "model_parallel_pp"
WORLD, SKIP, GLOBAL_BATCH = 4, 2, 4
MODEL = [
    "model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
    "precision.mode=fp32", f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=2",
]  # fmt: skip
Rows = dict[str, tuple[str, list[str]]]
"""Row key -> (label, layout overrides)."""
ROWS: Rows = {
    "fsdp": ("FSDP only (shard 4)", ["parallel.tp=1", "parallel.cp=1"]),
    "tp": ("dp2 x tp2 (+ sequence parallel)", ["parallel.tp=2", "parallel.cp=1"]),
    "cp": ("dp2 x cp2 (Ulysses)", ["parallel.tp=1", "parallel.cp=2"]),
    "cp-ring": (
        "dp2 x cp2 (ring)",
        ["parallel.tp=1", "parallel.cp=2", "parallel.cp_attention=ring"],
    ),
    "tpcp": ("tp2 x cp2", ["parallel.tp=2", "parallel.cp=2"]),
    "fsdp-B": ("FSDP only again (A/A control)", ["parallel.tp=1", "parallel.cp=1"]),
}
PP_MODEL = [*MODEL, "model.tie_embeddings=false", "train.micro_batch_size=1"]
"""The pipeline rows' model: untied (the embedding and the head on different stages)."""
PP_ROWS: Rows = {
    "fsdp": ("FSDP only (shard 4)", []),
    "pp2": ("pp2 x dp2, 1F1B", ["parallel.pp=2"]),
    "pp2-i": (
        "pp2 x dp2, Interleaved1F1B",
        ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B"],
    ),
    "pp4": ("pp4, 1F1B", ["parallel.pp=4"]),
    "pp2-tp2": ("pp2 x tp2, 1F1B", ["parallel.pp=2", "parallel.tp=2"]),
    "fsdp-B": ("FSDP only again (A/A control)", []),
}


def _vm_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _rank(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    """One rank of one run: build, read the resident set, train (run_ranks target)."""
    from fsdpkit.config.dims import parallel_dims
    from fsdpkit.run.resolve import resolve
    from fsdpkit.runtime.distenv import DistEnv
    from fsdpkit.train.loop import run
    from fsdpkit.train.session import build_session

    cfg = resolve(None, overrides, world_size=world, local_world_size=world).config
    env = DistEnv(
        rank=rank, world_size=world, local_rank=rank, local_world_size=world, device_type="cpu"
    )
    session = build_session(cfg, env)
    built = _vm_rss_mib()
    dims = parallel_dims(cfg, world_size=world, local_world_size=world)
    applied = [p for p in session.trainable.plan.describe().split("; ") if " parallel " in p]
    split = session.split
    layout = "; ".join([dims.describe(), *applied, f"{split.grad_accum} x {split.micro_batch}"])
    run(session)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"built_mib": built, "peak_mib": peak, "layout": layout}


def _one(
    key: str,
    *,
    steps: int,
    seq: int,
    cache: Path,
    tmp: Path,
    tag: str,
    layout: list[str] | None = None,
    model: list[str] = MODEL,
) -> dict[str, Any]:
    """One run of row ``key`` of ``model`` (``layout``: its overrides, default
    ``ROWS[key]``'s)."""
    from fsdpkit.testing import run_ranks

    run_dir = tmp / f"{key}-{tag}"
    overrides = [
        *model, *(ROWS[key][1] if layout is None else layout), f"data.seq_len={seq}",
        f"train.steps={steps}",
        f"data.cache_dir={cache}", f"logging.run_dir={run_dir}", "train.eval_every=0",
        "train.sample_tokens=0", "checkpoint.resume=never", "logging.progress=none",
        "logging.report=false",
    ]  # fmt: skip
    ranks = run_ranks(_rank, world_size=WORLD, args=(overrides,), timeout_s=900)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "loss" in r]
    steady = [r["step_time_s"] for r in steps_][SKIP:] or [r["step_time_s"] for r in steps_]
    return {
        "tokens_per_s": GLOBAL_BATCH * seq * len(steady) / sum(steady),
        "losses": [r["loss"] for r in steps_],
        "built_mib": [round(r["built_mib"], 1) for r in ranks],
        "peak_mib": [round(r["peak_mib"], 1) for r in ranks],
        "layout": ranks[0]["layout"],
    }


def measure(
    args: argparse.Namespace,
    rows: Rows = ROWS,
    model: list[str] = MODEL,
) -> tuple[dict[str, list[dict[str, Any]]], list[float]]:
    """{row: [one dict per round]} in A B C D E A' order, and the 1-minute load after
    each round (``rows`` of ``model``: bench/expert_parallel.py's too)."""
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in rows}
    loads = []
    first = next(iter(rows))
    with TemporaryDirectory(prefix="model-parallel-") as scratch:
        tmp = Path(scratch)
        shape: dict[str, Any] = {"seq": args.seq, "cache": tmp / "data", "tmp": tmp, "model": model}
        _one(first, steps=1, tag="prepare", layout=rows[first][1], **shape)  # corpus, not timed
        for rnd in range(args.rounds):
            for key in rows:
                t0 = time.monotonic()
                got = _one(key, steps=args.steps, tag=str(rnd), layout=rows[key][1], **shape)
                got["wall_s"] = round(time.monotonic() - t0, 1)
                out[key].append(got)
                print(
                    f"  round {rnd} {key:<6} {got['tokens_per_s']:7,.0f} tok/s  peak "
                    f"{max(got['peak_mib']):5.0f} MiB  after build {max(got['built_mib']):5.0f}"
                    f"  ({got['layout']})",
                    flush=True,
                )
            loads.append(round(os.getloadavg()[0], 2))
    return out, loads


def _median_of(runs: list[dict[str, Any]], field: str) -> float:
    """Median over rounds of the largest rank's figure."""
    return statistics.median(max(r[field]) for r in runs)


def rows_of(
    measured: dict[str, list[dict[str, Any]]],
    layouts: Rows = ROWS,
    base_key: str = "fsdp",
) -> list[dict[str, Any]]:
    """One results row per layout, its ratios against ``base_key``'s (FSDP only)."""
    base = measured[base_key]
    base_tps = [r["tokens_per_s"] for r in base]
    rows = []
    for key, (label, layout) in layouts.items():
        runs = measured[key]
        tps = [r["tokens_per_s"] for r in runs]
        peak, built = _median_of(runs, "peak_mib"), _median_of(runs, "built_mib")
        step_part = statistics.median(
            max(p - b for p, b in zip(r["peak_mib"], r["built_mib"], strict=True)) for r in runs
        )
        loss_diff = max(
            abs(a - b)
            for r, q in zip(runs, base, strict=True)
            for a, b in zip(r["losses"], q["losses"], strict=True)
        )
        rows.append({
            "key": key, "label": label, "overrides": layout, "layout": runs[0]["layout"],
            "tokens_per_s": [round(v, 1) for v in tps], "median": statistics.median(tps),
            "ratio": list(ratio(tps, base_tps)),
            "peak_mib": peak, "built_mib": built, "step_mib": step_part,
            "peak_per_rank_last": runs[-1]["peak_mib"], "max_loss_diff": loss_diff,
            "wall_s": [r["wall_s"] for r in runs],
        })  # fmt: skip
    fsdp = next(r for r in rows if r["key"] == base_key)
    for r in rows:
        r["peak_ratio"] = r["peak_mib"] / fsdp["peak_mib"]
        r["step_ratio"] = r["step_mib"] / fsdp["step_mib"]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="1 round of 4 steps")
    parser.add_argument("--pp", action="store_true", help="the pipeline rows (issue 38)")
    parser.add_argument(
        "--render-docs",
        metavar="FILE",
        type=Path,
        help="only rewrite FILE's model_parallel block from bench/results/model_parallel.json",
    )
    args = parser.parse_args(argv)
    name, rows, model = (PP_NAME, PP_ROWS, PP_MODEL) if args.pp else (NAME, ROWS, MODEL)
    if args.render_docs:
        text = render(results_io.read(name))
        results_io.render_into(args.render_docs.resolve(), name, text)
        return
    if args.quick:
        args.rounds, args.steps = 1, 4
    os.environ["OMP_NUM_THREADS"] = "1"
    settings = {"world": WORLD, "seq": args.seq, "steps": args.steps, "skip": SKIP,
                "rounds": args.rounds, "model": model}  # fmt: skip
    t0 = time.monotonic()
    measured, loads = measure(args, rows=rows, model=model)
    minutes = round((time.monotonic() - t0) / 60, 2)
    flags = f"--rounds {args.rounds} --steps {args.steps} --seq {args.seq}"
    results_io.write(
        name,
        command=f"python bench/{name}.py {flags}",
        settings=settings,
        minutes=minutes,
        load_1min_per_round=loads,
        rows=rows_of(measured, rows),
    )
    print(render(results_io.read(name)))


def _settings(results: dict[str, Any]) -> str:
    """The line under the provenance: the shape, the rounds, the machine's load."""
    s, loads = results["settings"], results["load_1min_per_round"]
    return (
        f"Built-in Llama, dim 256, 4 blocks, 8 query / 4 key-value heads, seq {s['seq']}, "
        f"fp32, chunked loss; global batch 4 sequences per step on every row; {s['world']} "
        f"gloo ranks; {s['steps']} steps per run (tokens/s over steps {s['skip'] + 1}-"
        f"{s['steps']}), {s['rounds']} rounds in A B C D E A' order, "
        f"{results['minutes']:.1f} min in all; 1-minute load after each round "
        f"{min(loads):.1f}-{max(loads):.1f} on a shared 2-core machine."
    )


def render(results: dict[str, Any]) -> str:
    """The docs block (the lead's docs/parallelism.md holds exactly this between the
    markers; tests/unit/test_bench_docs.py checks it)."""
    pipeline = any(r["key"].startswith("pp") for r in results["rows"])
    lines = [
        results_io.provenance(results, PP_NAME if pipeline else NAME),
        "",
        _settings(results),
        "",
        *table(results["rows"]),
    ]
    memory = _memory_pp(results) if pipeline else _memory(results)
    lines += ["", _speed(results, pipeline=pipeline), "", memory]
    return "\n".join(lines) + "\n"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table of ``rows_of``'s rows (bench/expert_parallel.py's too)."""
    lines = [
        "| layout | applied (accum x micro-batch per rank) | tokens/s median | vs FSDP only "
        "(per-round min-max) | peak RSS per rank | vs FSDP only | after build | step part "
        "(peak - after build) | vs FSDP only | max abs loss diff vs FSDP only |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mid, low, high = r["ratio"]
        lines.append(
            f"| {r['label']} | {r['layout']} | {r['median']:,.0f} | {mid:.2f} "
            f"({low:.2f}-{high:.2f}) | {r['peak_mib']:,.0f} MiB | {r['peak_ratio']:.2f} | "
            f"{r['built_mib']:,.0f} MiB | {r['step_mib']:,.0f} MiB | {r['step_ratio']:.2f} | "
            f"{r['max_loss_diff']:.1e} |"
        )
    return lines


def _row(results: dict[str, Any], key: str) -> dict[str, Any]:
    return next(r for r in results["rows"] if r["key"] == key)


def _speed(results: dict[str, Any], *, pipeline: bool = False) -> str:
    """What the tokens/s column shows: each layout judged by the A/A control's own
    spread (a layout whose every round lies outside it differs by more than noise)."""
    mid, low, high = _row(results, "fsdp-B")["ratio"]
    loads = results["load_1min_per_round"]
    layouts = [r for r in results["rows"] if r["key"] not in ("fsdp", "fsdp-B")]
    apart = [r for r in layouts if r["ratio"][2] < low or r["ratio"][1] > high]
    inside = [r for r in layouts if r not in apart]
    verdict = (
        f"{', '.join(r['label'] for r in apart)} lie outside it in every round (load "
        f"{min(loads):.0f}-{max(loads):.0f} on 2 cores: mostly the bench's own 4 ranks), "
        "so those ratios are what this machine measured. "
        if apart
        else ""
    ) + (
        f"{', '.join(r['label'] for r in inside)} overlap it, which shows nothing. "
        if inside
        else ""
    )
    return (
        f"Tokens/s: the A/A control (FSDP only run again) lands at {mid:.2f} of FSDP only, "
        f"its per-round ratios {low:.2f}-{high:.2f}. {verdict}"
        "What it measures is gloo on 2 CPU cores, not what the layouts cost on GPUs: 4 "
        "processes time-share 2 cores and gloo runs every collective on the compute thread, so "
        "nothing overlaps, and each collective a layout adds "
        + (_PIPELINE_COST if pipeline else _MODEL_PARALLEL_COST)
    )


_MODEL_PARALLEL_COST = (
    "(tensor parallelism: an all-gather and a reduce-scatter around every attention and "
    "MLP; Ulysses: 4 all-to-alls per layer; ring: the key / value exchange and, in "
    "backward, the gradients' rotation per layer) is paid in full. "
    "bench/gpu_model_parallel.py measures the layouts with NCCL, async TP and torch's ring "
    "attention on a machine with 2 or more GPUs."
)
_PIPELINE_COST = (
    "is paid in full; a pipeline's stages also wait for each other (its bubble: a stage "
    "idles until the previous one sends, 1F1B over 2 stages and 2 micro-batches idles a "
    "third of the step) while on 2 cores the waiting rank's time goes to the others. "
    "bench/gpu_model_parallel.py's pp2 row (prepared, not yet run) measures pp with NCCL."
)


def _memory_pp(results: dict[str, Any]) -> str:
    """What the memory columns show for the pipeline rows."""
    fsdp, pp2, pp4 = (_row(results, k) for k in ("fsdp", "pp2", "pp4"))
    return (
        "Memory: after the build a pipeline rank holds only its stage's blocks (and the "
        "embedding or the head), so the step part is the column to read: "
        f"{fsdp['step_mib']:.0f} MiB for FSDP only, x{pp2['step_ratio']:.2f} at pp2 x dp2 "
        f"(half the blocks per rank, FSDP over 2 ranks, 2 micro-batches) and "
        f"x{pp4['step_ratio']:.2f} at pp4 (a quarter of the blocks, no FSDP, 4 "
        "micro-batches of which the first stage keeps 4 in flight under 1F1B). The loss "
        "column shows the pipelines train the same numbers as FSDP only."
    )


def _memory(results: dict[str, Any]) -> str:
    """What the memory columns show, with the figures of this results file."""
    fsdp, tp, cp, both = (_row(results, k) for k in ("fsdp", "tp", "cp", "tpcp"))
    ring = _row(results, "cp-ring")
    return (
        "Memory is the meaningful column: the machine's load does not change it, and the "
        "ranks of a run agree within about 10 MiB. After the build every layout holds the "
        f"same ~{fsdp['built_mib']:.0f} MiB (interpreter, torch, a 3M-parameter model: at "
        "this size parameters are not what differs), so the step part (peak - after "
        "build: activations, gradients, optimizer state, gloo buffers) is what the layout "
        f"moves: {fsdp['step_mib']:.0f} MiB for FSDP only (1 sequence of "
        f"{results['settings']['seq']} tokens per rank); x{tp['step_ratio']:.2f} under dp2 "
        "x tp2, where each rank takes its data rank's 2 sequences, half the heads, "
        "hidden units and vocabulary, and under sequence parallelism half the residual "
        "stream; "
        f"x{cp['step_ratio']:.2f} under dp2 x cp2, whose ranks hold half of 2 sequences "
        "(as many tokens as FSDP only's) plus, per layer, the exchanged whole-sequence q / "
        f"k / v of their heads and the gathered mask; x{ring['step_ratio']:.2f} with ring "
        "attention at the same layout, whose ranks keep their half of each sequence with "
        "all heads and gather the other rank's keys and values, with fp32 merge and "
        "gradient accumulators around each attention; "
        f"x{both['step_ratio']:.2f} under tp2 "
        "x cp2 (2 micro-batches of 2 sequences: each rank half of each, as many tokens as "
        "FSDP only's, and half the heads and hidden units). That is where the design puts "
        "each share, not a measured breakdown; the loss column shows every layout trains "
        "the same numbers."
    )


if __name__ == "__main__":
    main()
