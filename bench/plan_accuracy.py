"""Planner accuracy: predicted vs measured per-rank peak memory on real CPU ranks.

    python bench/plan_accuracy.py            # the whole matrix (~6-10 min on 2 cores)
    python bench/plan_accuracy.py --quick    # the subset the tests use
    python bench/plan_accuracy.py --only V   # rows whose name starts with V
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
subset must not replace the matrix the docs quote).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import results_io

from fsdpkit.config import RunConfig, load
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.planner import plan
from fsdpkit.planner.measure import measure_step_peaks
from fsdpkit.planner.scenario import model_shape
from fsdpkit.testing import run_ranks
from fsdpkit.testing.hf import write_tiny_model

MODELS = {
    # fp32 models (bf16 matmuls are ~86x slower on CPUs without AVX512-BF16)
    "S": ["model.vocab_size=2048", "data.seq_len=128", "train.micro_batch_size=4"],
    "M": [
        "model.dim=384", "model.n_layers=6", "model.n_heads=6", "model.n_kv_heads=2",
        "model.ffn_dim=1024", "model.vocab_size=4096", "data.seq_len=256",
        "train.micro_batch_size=2",
    ],
    # large vocabularies: embedding and head hold most parameters (issue 8)
    "V1": [
        "model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=256", "model.vocab_size=2000", "model.tie_embeddings=false",
        "data.seq_len=96", "train.micro_batch_size=2",
    ],
    "V2": [
        "model.dim=256", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=512", "model.vocab_size=32000", "model.tie_embeddings=true",
        "data.seq_len=64", "train.micro_batch_size=2",
    ],
    "V3": [
        "model.dim=192", "model.n_layers=3", "model.n_heads=6", "model.n_kv_heads=2",
        "model.ffn_dim=512", "model.vocab_size=8000", "model.tie_embeddings=false",
        "data.seq_len=128", "train.micro_batch_size=2",
    ],
    # chunked loss (issue 12): tiny but wide, 32k vocabulary, 1024-token sequences
    "W": [
        "model.dim=256", "model.vocab_size=32768", "data.seq_len=1024",
        "train.micro_batch_size=2",
    ],
    # a tiny one for bf16
    "T": [
        "model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=344", "model.vocab_size=1024", "data.seq_len=64",
        "train.micro_batch_size=2",
    ],
}  # fmt: skip


HF_SHAPE = {"dim": 128, "layers": 3, "heads": 4, "kv_heads": 2, "ffn": 344, "vocab_size": 2048}
HF_MODELS = {
    # model.hf directories (config.json only: the model's own random init), issue 10
    "HL": "llama",
    "HM": "mistral",
    "HQ": "qwen2",
    "HG": "gpt2",
    "HGe": "gemma",
}
HF_RUN = ["data.seq_len=128", "train.micro_batch_size=2"]
_HF_ROOT = Path(tempfile.mkdtemp(prefix="fsdpkit-plan-accuracy-"))


@functools.cache
def hf_dir(arch: str) -> str:
    """A config-only model directory of ``arch`` (written once per bench run)."""
    out = _HF_ROOT / arch
    write_tiny_model(out, arch=arch, weights=False, tokenizer=False, **HF_SHAPE)
    return str(out)


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    model: str
    overrides: tuple[str, ...]

    def config(self) -> RunConfig:
        if self.model in HF_MODELS:
            model = [f"model.hf={hf_dir(HF_MODELS[self.model])}", *HF_RUN]
        else:
            model = ["model.preset=tiny", *MODELS[self.model]]
        return load(None, [*model, "precision.mode=fp32", *self.overrides])

    def shape(self) -> LlamaConfig | None:
        """The built-in model's shape (None: a model.hf model, built by the trainer)."""
        return None if self.model in HF_MODELS else model_shape(self.config())


FULL, GRAD_OP, REPL = (
    "parallel.strategy=full",
    "parallel.strategy=grad_op",
    "parallel.strategy=replicate",
)
AC, EVERY = "activations.mode=full", "activations.mode=every"
BF16 = "precision.mode=bf16"
HYBRID = ("parallel.strategy=hybrid", "parallel.shard_degree=2")
SYNC_EVERY = "parallel.accum_sync=every"
NO_EDGES = "parallel.edge_units=false"
EVERY_KEEP = (SYNC_EVERY, "parallel.accum_keep_unsharded=true")
PREFETCH_2_2 = ("parallel.forward_prefetch=2", "parallel.backward_prefetch=2")
PREFETCH_2_3 = ("parallel.forward_prefetch=2", "parallel.backward_prefetch=3")

MODELS["A"] = [  # issue 12: activations dominate (seq 512, 4 blocks, GQA)
    "model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_dim=688", "model.vocab_size=2048", "data.seq_len=512",
    "train.micro_batch_size=2",
]  # fmt: skip
SEL, ACT_MODES = "activations.mode=selective", ("none", "selective", "full")

CASES = [
    Case("S full", 1, "S", (FULL,)),
    Case("M full +AC", 1, "M", (FULL, AC)),
    Case("S full", 2, "S", (FULL,)),
    Case("S full +AC", 2, "S", (FULL, AC)),
    Case("S grad_op", 2, "S", (GRAD_OP,)),
    Case("S grad_op +AC", 2, "S", (GRAD_OP, AC)),
    Case("S replicate", 2, "S", (REPL,)),
    Case("S full accum=2", 2, "S", (FULL, "train.grad_accum=2")),
    Case("S full AC every 2", 2, "S", (FULL, EVERY)),
    Case("S full 2 blocks/unit", 2, "S", (FULL, "parallel.blocks_per_unit=2")),
    Case("S full 4 blocks/unit +AC", 2, "S", (FULL, AC, "parallel.blocks_per_unit=4")),
    Case("M full", 2, "M", (FULL,)),
    Case("M full +AC", 2, "M", (FULL, AC)),
    Case("M grad_op +AC", 2, "M", (GRAD_OP, AC)),
    Case("T bf16 full", 2, "T", (FULL, BF16)),
    Case("T bf16 full +AC", 2, "T", (FULL, BF16, AC)),
    Case("T bf16 grad_op", 2, "T", (GRAD_OP, BF16)),
    Case("S hybrid 2x2", 4, "S", HYBRID),
    Case("S full +AC", 4, "S", (FULL, AC)),
    Case("S full raf=2", 4, "S", (FULL, "parallel.reshard_after_forward=2")),
    Case("M full +AC", 4, "M", (FULL, AC)),
    Case("T bf16 hybrid +AC", 4, "T", (*HYBRID, BF16, AC)),
    # issue 8: large vocabularies, world size 3, three blocks per unit
    Case("V1 bf16 full +AC", 3, "V1", (FULL, BF16, AC)),
    Case("V1 full", 2, "V1", (FULL,)),
    Case("V1 full +AC", 3, "V1", (FULL, AC)),
    Case("V2 full", 2, "V2", (FULL,)),
    Case("V2 full +AC", 2, "V2", (FULL, AC)),
    Case("V2 grad_op", 3, "V2", (GRAD_OP,)),
    Case("V3 full", 3, "V3", (FULL,)),
    Case("V3 full AC every 2", 2, "V3", (FULL, EVERY)),
    Case("S full", 3, "S", (FULL,)),
    Case("S grad_op +AC", 3, "S", (GRAD_OP, AC)),
    Case("S full 3 blocks/unit", 2, "S", (FULL, "parallel.blocks_per_unit=3")),
    Case("S full 3 blocks/unit +AC", 3, "S", (FULL, AC, "parallel.blocks_per_unit=3")),
    Case("M full 3 blocks/unit", 2, "M", (FULL, "parallel.blocks_per_unit=3")),
    # issue 10: Hugging Face models (model.hf); analytic for the Llama family only
    Case("HL hf llama full", 2, "HL", (FULL,)),
    Case("HL hf llama full +AC", 2, "HL", (FULL, AC)),
    Case("HM hf mistral grad_op", 2, "HM", (GRAD_OP,)),
    Case("HQ hf qwen2 full", 2, "HQ", (FULL,)),
    Case("HG hf gpt2 full", 2, "HG", (FULL,)),
    Case("HG hf gpt2 full +AC", 2, "HG", (FULL, AC)),
    Case("HGe hf gemma full", 2, "HGe", (FULL,)),
    # issue 12: op-level selective checkpointing, beside none and full on the same model
    *(Case(f"ACT A {m}", 2, "A", (FULL, f"activations.mode={m}")) for m in ACT_MODES),
    Case("ACT A selective MHA", 2, "A", (FULL, SEL, "model.n_kv_heads=4")),
    Case("ACT S selective grad_op", 2, "S", (GRAD_OP, SEL)),
    Case("ACT M selective", 3, "M", (FULL, SEL)),
    Case("ACT T bf16 selective", 2, "T", (FULL, BF16, SEL)),
    Case("ACT HL hf llama selective", 2, "HL", (FULL, SEL)),
    Case("ACT HQ hf qwen2 selective", 2, "HQ", (FULL, SEL)),
    # issue 12: accumulation modes (parallel.accum_sync) and explicit prefetch
    Case("ACC S accum=2 every", 2, "S", (FULL, "train.grad_accum=2", "parallel.accum_sync=every")),
    Case("ACC S accum=4 last", 2, "S", (FULL, "train.grad_accum=4", "parallel.accum_sync=last")),
    Case("ACC S accum=4 every", 2, "S", (FULL, "train.grad_accum=4", "parallel.accum_sync=every")),
    Case("ACC M accum=3 last", 2, "M", (FULL, "train.grad_accum=3", "parallel.accum_sync=last")),
    Case("ACC M accum=3 every", 2, "M", (FULL, "train.grad_accum=3", "parallel.accum_sync=every")),
    Case("ACC S accum=3 every keep", 2, "S", (FULL, "train.grad_accum=3", *EVERY_KEEP)),
    Case("ACC T bf16 accum=2 every", 2, "T", (FULL, BF16, "train.grad_accum=2", SYNC_EVERY)),
    Case("ACC S hybrid accum=2 every", 4, "S", (*HYBRID, "train.grad_accum=2", SYNC_EVERY)),
    Case("ACC S prefetch fwd2 bwd2", 2, "S", (FULL, *PREFETCH_2_2)),
    Case("ACC M prefetch fwd2 bwd3 +AC", 2, "M", (FULL, AC, *PREFETCH_2_3)),
    # the optimizer step peaks at world size 1 with AC: each AdamW kernel's temporary
    Case("ACC M opt for-loop +AC", 1, "M", (FULL, AC, "train.optimizer_impl=for-loop")),
    Case("ACC M opt foreach +AC", 1, "M", (FULL, AC, "train.optimizer_impl=foreach")),
    Case("ACC M opt fused +AC", 1, "M", (FULL, AC, "train.optimizer_impl=fused")),
    # issue 12: chunked linear cross-entropy against full logits
    Case("W full logits", 2, "W", (FULL, "train.chunked_loss=off")),
    Case("W chunked", 2, "W", (FULL, "train.chunked_loss=on")),
    Case("W chunked 256", 2, "W", (FULL, "train.chunked_loss=on", "train.loss_chunk_tokens=256")),
    Case("W full logits +AC", 2, "W", (FULL, AC, "train.chunked_loss=off")),
    Case("W chunked +AC", 2, "W", (FULL, AC, "train.chunked_loss=on")),
    Case("W chunked untied", 2, "W", (FULL, "train.chunked_loss=on", "model.tie_embeddings=false")),
    Case(
        "T bf16 chunked 48",
        2,
        "T",
        (FULL, BF16, "train.chunked_loss=on", "train.loss_chunk_tokens=48"),
    ),
    # untied embedding, norm and head in the root unit (parallel.edge_units=false); the
    # V1/V3/W untied rows above have them as units of their own (the default)
    Case("V1 bf16 full +AC root edges", 3, "V1", (FULL, BF16, AC, NO_EDGES)),
    Case("V3 full root edges", 3, "V3", (FULL, NO_EDGES)),
    Case("W chunked untied root edges", 2, "W", (FULL, "model.tie_embeddings=false", NO_EDGES)),
    Case("V1 grad_op +AC", 2, "V1", (GRAD_OP, AC)),
    Case("V3 full accum=2 every", 3, "V3", (FULL, "train.grad_accum=2", SYNC_EVERY)),
]
QUICK = [c for c in CASES if c.world == 2 and c.name in ("S full +AC", "S grad_op", "T bf16 full")]
"""The subset tests/distributed/test_planner_accuracy.py checks."""


def measure(cases: list[Case], *, steps: int) -> dict[tuple[str, int], list[int]]:
    """True per-rank peaks of ``steps`` steps (per step the max over ranks), one spawn
    per world size."""
    out = {}
    for world in sorted({c.world for c in cases}):
        group = [c for c in cases if c.world == world]
        specs = [(c.name, c.config(), c.shape()) for c in group]
        per_rank = run_ranks(
            measure_step_peaks, world_size=world, args=(specs, steps), timeout_s=1800
        )
        for c in group:
            out[(c.name, world)] = [max(step) for step in zip(*(r[c.name] for r in per_rank))]
    return out


@dataclass(frozen=True)
class Result:
    case: Case
    steps: tuple[int, ...]
    """Measured peak of each step."""
    analytic: int | None
    """None: a model the analytic planner does not replay (traced only)."""
    traced: int
    spread: int
    """The planner's reported step-to-step spread above its peak."""
    where: str

    @property
    def typical(self) -> int:
        return int(statistics.median(self.steps))

    @property
    def worst(self) -> int:
        return max(self.steps)

    def error(self, predicted: int, *, worst: bool = False) -> float:
        truth = self.worst if worst else self.typical
        return (predicted - truth) / truth


def rows(cases: list[Case], *, steps: int) -> list[Result]:
    """Measured, analytic and traced peaks of every case."""
    measured = measure(cases, steps=steps)
    out = []
    for c in cases:
        traced = plan(c.config(), world_size=c.world, trace=True)
        other = traced.other  # the analytic plan rides along where it applies
        peak = (other or traced.memory).peak
        out.append(
            Result(
                case=c,
                steps=tuple(measured[(c.name, c.world)]),
                analytic=other.peak.bytes if other is not None else None,
                traced=traced.memory.peak.bytes,
                spread=traced.memory.spread,
                where=f"{peak.phase}: {peak.where}",
            )
        )
    return out


def table(results: list[Result]) -> str:
    mib = 2**20
    head = f"{'configuration':<26}{'ws':>3}{'typical':>10}{'worst':>9}{'analytic':>10}"
    head += f"{'err':>7}{'(worst)':>8}{'traced':>9}{'err':>7}{'(worst)':>8}{'bound':>7}  peak at"
    lines = [head, "-" * len(head)]
    for r in results:
        bound = r.analytic if r.analytic is not None else r.traced
        covered = "ok" if bound + r.spread >= r.worst * 0.995 else "BELOW"
        analytic = "      -       -       -"
        if r.analytic is not None:
            analytic = (
                f"{r.analytic / mib:>9.2f}M{r.error(r.analytic):>+7.1%}"
                f"{r.error(r.analytic, worst=True):>+8.1%}"
            )
        lines.append(
            f"{r.case.name:<26}{r.case.world:>3}{r.typical / mib:>9.2f}M{r.worst / mib:>8.2f}M"
            f"{analytic}{r.traced / mib:>8.2f}M"
            f"{r.error(r.traced):>+7.1%}{r.error(r.traced, worst=True):>+8.1%}{covered:>7}"
            f"  {r.where}"
        )
    return "\n".join(lines)


NAME = "plan_accuracy"
DOCS = results_io.ROOT / "docs" / "planner.md"
MIB = 2**20


def record(r: Result) -> dict[str, Any]:
    """One row of the results file: the measured steps and both plans, in bytes."""
    return {
        "configuration": r.case.name, "world": r.case.world, "steps": list(r.steps),
        "typical": r.typical, "worst": r.worst, "analytic": r.analytic, "traced": r.traced,
        "spread": r.spread, "peak_at": r.where,
    }  # fmt: skip


def _err(predicted: int | None, truth: int) -> str:
    return "-" if predicted is None else f"{(predicted - truth) / truth:+.1%}"


def render(results: dict[str, Any]) -> str:
    """docs/planner.md's table and its worst errors (tests/unit/test_bench_docs.py)."""
    lines = [
        results_io.provenance(results, NAME),
        "",
        "| configuration | ranks | typical | worst | analytic | err | (worst) | traced | err "
        "| (worst) | bound | peak at |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in results["rows"]:
        bound = r["analytic"] if r["analytic"] is not None else r["traced"]
        covered = "ok" if bound + r["spread"] >= r["worst"] * 0.995 else "BELOW"
        a = "-" if r["analytic"] is None else f"{r['analytic'] / MIB:.2f} MiB"
        lines.append(
            f"| {r['configuration']} | {r['world']} | {r['typical'] / MIB:.2f} MiB | "
            f"{r['worst'] / MIB:.2f} MiB | {a} | {_err(r['analytic'], r['typical'])} | "
            f"{_err(r['analytic'], r['worst'])} | {r['traced'] / MIB:.2f} MiB | "
            f"{_err(r['traced'], r['typical'])} | {_err(r['traced'], r['worst'])} | {covered} "
            f"| {r['peak_at']} |"
        )
    w = results["worst_error"]
    lines += [
        "",
        f"{len(results['rows'])} configurations x {results['steps']} steps in "
        f"{results['seconds']:.0f} s. Worst error vs the typical step: analytic "
        f"{w['analytic_typical']:.1%}, traced {w['traced_typical']:.1%} (target 3%); vs the "
        f"worst step: analytic {w['analytic_worst']:.1%}, traced {w['traced_worst']:.1%} "
        "(target 5%).",
    ]
    return "\n".join(lines) + "\n"


def worst_errors(results: list[Result]) -> dict[str, float]:
    analytic = [r for r in results if r.analytic is not None]
    return {
        "analytic_typical": max((abs(r.error(r.analytic)) for r in analytic), default=0.0),  # type: ignore[arg-type]
        "traced_typical": max(abs(r.error(r.traced)) for r in results),
        "analytic_worst": max(
            (abs(r.error(r.analytic, worst=True)) for r in analytic),  # type: ignore[arg-type]
            default=0.0,
        ),
        "traced_worst": max(abs(r.error(r.traced, worst=True)) for r in results),
    }


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the tests' subset")
    parser.add_argument("--only", default="", help="rows whose name starts with this")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per row")
    parser.add_argument("--render-docs", action="store_true", help="only re-render the docs")
    args = parser.parse_args(argv)
    if args.render_docs:
        render_docs()
        return 0
    start = time.perf_counter()
    cases = [c for c in (QUICK if args.quick else CASES) if c.name.startswith(args.only)]
    results = rows(cases, steps=args.steps)
    seconds = time.perf_counter() - start
    print(table(results))
    w = worst_errors(results)
    print(
        f"\nworst error vs the typical step: analytic {w['analytic_typical']:.1%}, traced "
        f"{w['traced_typical']:.1%} (target 3%); vs the worst step: analytic "
        f"{w['analytic_worst']:.1%}, traced {w['traced_worst']:.1%} (target 5%); "
        f"{len(results)} configurations x {args.steps} steps in {seconds:.0f} s"
    )
    if cases == CASES:
        results_io.write(
            NAME, steps=args.steps, seconds=round(seconds, 1), worst_error=w,
            rows=[record(r) for r in results],
        )  # fmt: skip
        render_docs()
    typical = max(w["analytic_typical"], w["traced_typical"])
    return 0 if typical <= 0.03 and max(w["analytic_worst"], w["traced_worst"]) <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
