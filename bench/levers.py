"""Issue 12's levers, each on vs off: tokens/s and peak memory in one table.

    python bench/levers.py                    # every lever, 3 alternating rounds, 2 CPU ranks
    python bench/levers.py --only accum --reps 6 --steps 8

Each row of ``LEVERS`` is (name, off-overrides, on-overrides): ``fsdpkit train`` config
keys (dotted, as on the command line) applied over ``BASE``; add a lever by adding a
row. One process tree: 2 gloo ranks (fsdpkit.testing.run_ranks) build every variant as
``fsdpkit train`` does (``build_session``: data, model, shard, optimizer, the trainer's
loss) and run the trainer's own step (``fsdpkit.train.loop._step``), in alternating
order — round 1: lever A off, A on, B off, B on, ...; round 2 the same — so load from
other processes hits both sides alike. The control row runs the same config as both
"off" and "on" (same vs same): its ratio is the noise floor.

Per run: ``--warmup`` steps untimed (first-step costs, compilation), then ``--steps``
timed steps: tokens/s = global batch x seq / median step time. Then one more step is
measured for peak memory: the true peak of live CPU tensor bytes, as
bench/plan_accuracy.py measures it (c10's process-wide allocator count, [Note:
measuring CPU peaks] in fsdpkit.cpumem), above what the rank held before the
session was built, max over ranks. Reported per lever: median tokens/s and peak of
each side over the rounds, and on/off ratios. bench/gpu_levers.py prints the same
table on GPUs (NCCL, torchrun; peak = torch.cuda.max_memory_allocated). A run of every
lever (no ``--only``) writes ``bench/results/levers.json`` and renders docs/levers.md's
table from it; ``--render-docs`` only re-renders.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import results_io
import torch

Lever = tuple[str, tuple[str, ...], tuple[str, ...]]

BASE: tuple[str, ...] = (
    "model.preset=tiny", "model.dim=256", "model.n_layers=4", "model.n_heads=4",
    "model.n_kv_heads=2", "model.ffn_dim=688", "model.vocab_size=32768",
    "data.seq_len=256", "data.max_bytes=400000", "train.micro_batch_size=2",
    "precision.mode=fp32", "train.eval_every=0", "train.sample_tokens=0",
    "checkpoint.every=0", "checkpoint.resume=never", "logging.progress=none",
    "logging.report=false",
)  # fmt: skip
"""fp32 (bf16 matmuls are ~86x slower on these CPUs), a 32k vocabulary, 2 ranks."""

LEVERS: list[Lever] = [
    ("control (same vs same)", (), ()),
    (
        "accum_sync every vs last (2 micro)",
        ("train.grad_accum=2", "parallel.accum_sync=last"),
        ("train.grad_accum=2", "parallel.accum_sync=every"),
    ),
    (
        "optimizer fused vs foreach (offload)",
        ("offload.params=true", "train.optimizer_impl=foreach"),
        ("offload.params=true", "train.optimizer_impl=fused"),
    ),
    (
        "optimizer fused vs for-loop",
        ("train.optimizer_impl=for-loop",),
        ("train.optimizer_impl=fused",),
    ),
    ("forward_prefetch 2 vs 0", ("parallel.forward_prefetch=0",), ("parallel.forward_prefetch=2",)),
    (
        "backward_prefetch 2 vs 1",
        ("parallel.backward_prefetch=1",),
        ("parallel.backward_prefetch=2",),
    ),
    ("chunked loss on vs off", ("train.chunked_loss=off",), ("train.chunked_loss=on",)),
    ("selective AC vs none", ("activations.mode=none",), ("activations.mode=selective",)),
    ("selective AC vs full", ("activations.mode=full",), ("activations.mode=selective",)),
    (
        "edge units on vs off (untied)",
        ("model.tie_embeddings=false", "parallel.edge_units=false"),
        ("model.tie_embeddings=false", "parallel.edge_units=true"),
    ),
]
"""(name, off-overrides, on-overrides). train.compile has its own bench,
bench/act_levers.py: each compiled run there resets dynamo and compiles (warm on-disk
cache), and the cold first compile is measured apart, which this table's shared
warm-up does not do."""


@dataclass(frozen=True)
class Sample:
    """One run of one side of one lever on this rank."""

    tokens_per_s: float
    peak_bytes: int


def run_one(
    overrides: Sequence[str], *, steps: int, warmup: int, peak: PeakFn, base: Sequence[str] = BASE
) -> Sample:
    """Build a session as ``fsdpkit train`` does, time ``steps`` steps after
    ``warmup``, then measure one step's peak with ``peak``."""
    from fsdpkit.config import load
    from fsdpkit.runtime.distenv import joined_env
    from fsdpkit.runtime.hangs import HangProbe
    from fsdpkit.train.loop import _step
    from fsdpkit.train.session import build_session

    env = joined_env()
    assert env is not None, "run under run_ranks or torchrun"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load(None, [*base, *overrides, f"logging.run_dir={tmp}"])
        before = peak.live()
        s = build_session(cfg, env)
        probe = HangProbe.off()
        for _ in range(warmup):
            _step(s, probe)
        times = []
        for _ in range(steps):
            peak.sync()
            start = time.perf_counter()
            _step(s, probe)
            peak.sync()
            times.append(time.perf_counter() - start)
        top = peak.of(lambda: _step(s, probe)) - before
        tokens = s.split.global_batch * cfg.data.seq_len
    return Sample(tokens / statistics.median(times), top)


class PeakFn:
    """Peak live tensor bytes of a call: c10's CPU count, or CUDA's allocator."""

    def __init__(self, device_type: str) -> None:
        self.cuda = device_type == "cuda"
        if not self.cuda:
            from fsdpkit.cpumem import enable_process_wide_accounting

            enable_process_wide_accounting()

    def live(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated()
        from fsdpkit.cpumem import live_bytes

        return live_bytes()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def of(self, fn: Callable[[], object]) -> int:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        from fsdpkit.cpumem import peak_bytes

        return peak_bytes(fn)


def measure(
    rank: int,
    world: int,
    levers: list[Lever],
    reps: int,
    steps: int,
    warmup: int,
    device: str,
    base: Sequence[str] = BASE,
) -> dict[str, dict[str, list[tuple[float, int]]]]:
    """Worker (every rank): all levers, both sides, ``reps`` alternating rounds;
    per lever and side the (tokens/s, peak bytes of this rank) of each round."""
    peak = PeakFn(device)
    out: dict[str, dict[str, list[tuple[float, int]]]] = {
        name: {"off": [], "on": []} for name, _, _ in levers
    }
    run_one((), steps=1, warmup=1, peak=peak, base=base)  # first-session costs (imports, caches)
    for _ in range(reps):
        for name, off, on in levers:
            for side, overrides in (("off", off), ("on", on)):
                sample = run_one(overrides, steps=steps, warmup=warmup, peak=peak, base=base)
                gc.collect()  # the session is gone before the next one is built
                out[name][side].append((sample.tokens_per_s, sample.peak_bytes))
                if rank == 0:  # progress, on stderr
                    print(f"{name} {side}: {sample.tokens_per_s:,.0f} tok/s", file=sys.stderr)
    return out


def merge(per_rank: list[dict[str, dict[str, list[tuple[float, int]]]]]) -> dict[str, Any]:
    """Tokens/s of rank 0 (global, all ranks step together), peak = max over ranks."""
    merged: dict[str, Any] = {}
    for name, sides in per_rank[0].items():
        merged[name] = {}
        for side, runs in sides.items():
            peaks = [max(r[name][side][i][1] for r in per_rank) for i in range(len(runs))]
            merged[name][side] = ([t for t, _ in runs], peaks)
    return merged


def table(merged: dict[str, Any], *, memory: str) -> str:
    mib = 2**20
    head = (
        f"{'lever':<38}{'off tok/s':>11}{'on tok/s':>10}{'ratio':>7}"
        f"{'off peak':>11}{'on peak':>10}{'ratio':>7}  tok/s ratio per round"
    )
    lines = [head, "-" * len(head)]
    for name, sides in merged.items():
        (t_off, p_off), (t_on, p_on) = sides["off"], sides["on"]
        to, tn = statistics.median(t_off), statistics.median(t_on)
        po, pn = statistics.median(p_off), statistics.median(p_on)
        rounds = " ".join(f"{b / a:.2f}" for a, b in zip(t_off, t_on))
        lines.append(
            f"{name:<38}{to:>11,.0f}{tn:>10,.0f}{tn / to:>7.2f}"
            f"{po / mib:>10.1f}M{pn / mib:>9.1f}M{pn / po:>7.2f}  {rounds}"
        )
    lines.append(f"peak: {memory}; tokens/s: global (all ranks), median over rounds")
    return "\n".join(lines)


NAME = "levers"
DOCS = results_io.ROOT / "docs" / "levers.md"


def rows(merged: dict[str, Any]) -> list[dict[str, Any]]:
    """Per lever: each round's tokens/s and peak bytes of both sides, and the medians."""
    out = []
    for name, sides in merged.items():
        (t_off, p_off), (t_on, p_on) = sides["off"], sides["on"]
        out.append(
            {
                "lever": name, "off_tok_s": t_off, "on_tok_s": t_on, "off_peak": p_off,
                "on_peak": p_on, "off_tok_s_median": statistics.median(t_off),
                "on_tok_s_median": statistics.median(t_on),
                "off_peak_median": statistics.median(p_off),
                "on_peak_median": statistics.median(p_on),
            }
        )  # fmt: skip
    return out


def render(results: dict[str, Any]) -> str:
    """docs/levers.md's table (tests/unit/test_bench_docs.py checks it)."""
    mib = 2**20
    lines = [
        results_io.provenance(results, NAME),
        "",
        f"2 CPU ranks (gloo), fp32, {results['base']}, seq 256 x 2 per rank; "
        f"{results['reps']} alternating rounds x ({results['warmup']} warm-up + "
        f"{results['steps']} timed steps) per side, {results['seconds']:.0f} s. Peak: true "
        "peak of live CPU tensor bytes per rank (c10 allocator count), max over ranks; "
        "tokens/s: global (all ranks), median over rounds.",
        "",
        "| lever | off tok/s | on tok/s | ratio | off peak | on peak | ratio | tok/s ratio "
        "per round |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results["rows"]:
        to, tn = r["off_tok_s_median"], r["on_tok_s_median"]
        po, pn = r["off_peak_median"], r["on_peak_median"]
        rounds = " ".join(f"{b / a:.2f}" for a, b in zip(r["off_tok_s"], r["on_tok_s"]))
        lines.append(
            f"| {r['lever']} | {to:,.0f} | {tn:,.0f} | {tn / to:.2f} | {po / mib:.1f} MiB | "
            f"{pn / mib:.1f} MiB | {pn / po:.2f} | {rounds} |"
        )
    return "\n".join(lines) + "\n"


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def select(only: str) -> list[Lever]:
    chosen = [lv for lv in LEVERS if only.lower() in lv[0].lower()]
    return [LEVERS[0], *[lv for lv in chosen if lv is not LEVERS[0]]]  # always the control


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--only", default="", help="levers whose name contains this (+ control)")
    p.add_argument("--reps", type=int, default=3, help="alternating rounds")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__ or "")  # bench/gpu_levers.py shares it; rendering is CPU-only
    p.add_argument("--render-docs", action="store_true", help="only re-render docs/levers.md")
    args = p.parse_args(argv)
    if args.render_docs:
        render_docs()
        return 0
    from fsdpkit.testing import run_ranks

    levers = select(args.only)
    start = time.perf_counter()
    per_rank = run_ranks(
        measure,
        world_size=2,
        args=(levers, args.reps, args.steps, args.warmup, "cpu"),
        timeout_s=7200,
    )
    print(
        f"issue 12 levers, on vs off: 2 CPU ranks (gloo), fp32, {' '.join(BASE[:7])}, "
        f"seq 256 x 2 per rank; {args.reps} alternating rounds x ({args.warmup} warm-up + "
        f"{args.steps} timed steps) per side; {time.perf_counter() - start:.0f} s"
    )
    memory = "true peak of live CPU tensor bytes per rank (c10 allocator count), max over ranks"
    merged = merge(per_rank)
    print(table(merged, memory=memory))
    if not args.only:
        results_io.write(
            NAME, base=" ".join(BASE[:7]), reps=args.reps, steps=args.steps,
            warmup=args.warmup, seconds=round(time.perf_counter() - start, 1), rows=rows(merged),
        )  # fmt: skip
        render_docs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
