"""Planner accuracy: predicted vs measured per-rank peak memory on real CPU ranks.

    python bench/plan_accuracy.py            # the whole matrix (~2-3 min on 2 cores)
    python bench/plan_accuracy.py --quick    # the subset the tests use

Every configuration trains real steps with fsdpkit.shard on gloo ranks
(fsdpkit.testing.run_ranks) and measures the true peak of live CPU tensor memory of a
steady-state step (c10's process-wide allocator count, see [Note: measuring CPU
peaks] in fsdpkit.planner.measure); the parent plans the same configuration
analytically and traced, and prints the table. Targets: analytic within 10%, traced
within 5% of measured on every row.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from fsdpkit.config import RunConfig, load
from fsdpkit.planner import plan
from fsdpkit.planner.measure import measure_step_peaks
from fsdpkit.planner.scenario import model_config
from fsdpkit.testing import run_ranks

MODELS = {
    # fp32 models (bf16 matmuls are ~86x slower on CPUs without AVX512-BF16)
    "S": ["model.vocab_size=2048", "data.seq_len=128", "train.micro_batch_size=4"],
    "M": [
        "model.dim=384", "model.n_layers=6", "model.n_heads=6", "model.n_kv_heads=2",
        "model.ffn_dim=1024", "model.vocab_size=4096", "data.seq_len=256",
        "train.micro_batch_size=2",
    ],
    # a tiny one for bf16
    "T": [
        "model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=344", "model.vocab_size=1024", "data.seq_len=64",
        "train.micro_batch_size=2",
    ],
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    model: str
    overrides: tuple[str, ...]

    def config(self) -> RunConfig:
        return load(
            None, ["model.preset=tiny", "precision.mode=fp32", *MODELS[self.model], *self.overrides]
        )


FULL, GRAD_OP, REPL = (
    "parallel.strategy=full",
    "parallel.strategy=grad_op",
    "parallel.strategy=replicate",
)
AC, EVERY = "activations.mode=full", "activations.mode=every"
BF16 = "precision.mode=bf16"
HYBRID = ("parallel.strategy=hybrid", "parallel.shard_degree=2")

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
]
QUICK = [c for c in CASES if c.world == 2 and c.name in ("S full +AC", "S grad_op", "T bf16 full")]
"""The subset tests/distributed/test_planner_accuracy.py checks."""


def measure(cases: list[Case]) -> dict[tuple[str, int], int]:
    """True per-rank peaks (max over ranks), one spawn per world size."""
    out = {}
    for world in sorted({c.world for c in cases}):
        group = [c for c in cases if c.world == world]
        specs = [(c.name, c.config(), model_config(c.config())) for c in group]
        per_rank = run_ranks(measure_step_peaks, world_size=world, args=(specs,), timeout_s=900)
        for c in group:
            out[(c.name, world)] = max(r[c.name] for r in per_rank)
    return out


@dataclass(frozen=True)
class Result:
    case: Case
    measured: int
    analytic: int
    traced: int
    where: str

    def error(self, predicted: int) -> float:
        return (predicted - self.measured) / self.measured


def rows(cases: list[Case]) -> list[Result]:
    """Measured, analytic and traced peaks of every case."""
    measured = measure(cases)
    out = []
    for c in cases:
        traced = plan(c.config(), world_size=c.world, trace=True)
        assert traced.other is not None  # the analytic plan rides along
        peak = traced.other.peak
        out.append(
            Result(
                case=c,
                measured=measured[(c.name, c.world)],
                analytic=peak.bytes,
                traced=traced.memory.peak.bytes,
                where=f"{peak.phase}: {peak.where}",
            )
        )
    return out


def table(results: list[Result]) -> str:
    head = f"{'configuration':<26}{'ws':>3}{'measured':>11}{'analytic':>11}{'err':>7}"
    head += f"{'traced':>11}{'err':>7}  peak at (analytic)"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.case.name:<26}{r.case.world:>3}{r.measured / 2**20:>10.2f}M"
            f"{r.analytic / 2**20:>10.2f}M{r.error(r.analytic):>+7.1%}"
            f"{r.traced / 2**20:>10.2f}M{r.error(r.traced):>+7.1%}  {r.where}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the tests' subset")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = rows(QUICK if args.quick else CASES)
    print(table(results))
    worst_a = max(abs(r.error(r.analytic)) for r in results)
    worst_t = max(abs(r.error(r.traced)) for r in results)
    print(
        f"\nworst error: analytic {worst_a:.1%} (target 10%), traced {worst_t:.1%} (target 5%); "
        f"{len(results)} configurations in {time.perf_counter() - start:.0f} s"
    )
    return 0 if worst_a <= 0.10 and worst_t <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
