"""The statistics of bench/peers.py (pure; unit-tested in tests/unit/test_peers_stats.py).

- ``abba``: the run order. Repetition r runs the rows forward when r is even and
  backward when odd (A B C, C B A, A B C, ...), so slow drift on a shared machine hits
  every row alike.
- ``summarize``: per row the median tokens/s with its min-max over repetitions, the
  ratio to the baseline row (``ratio``: median over median, and the min-max of the
  per-repetition ratios, which pair runs made in the same repetition), the largest
  loss difference from the
  reference row over every step of every repetition, and the verdict: a row whose loss
  differs from the reference by more than ``tol`` at any step is WRONG, whatever its speed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class Runs:
    """What the repetitions of one row measured."""

    tokens_per_s: list[float] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)
    peak_mib: list[float] = field(default_factory=list)  # per rank, from the last repetition
    shard_fraction: float | None = None
    note: str = ""
    error: str | None = None
    adamw: str = ""  # the AdamW kernel the row's optimizer was built with
    wall_s: list[float] = field(default_factory=list)  # each launch, start to exit


@dataclass(frozen=True)
class Summary:
    name: str
    median: float | None
    low: float | None
    high: float | None
    ratio: float | None
    ratio_low: float | None
    ratio_high: float | None
    max_loss_diff: float | None
    verdict: str


def abba(names: list[str], reps: int) -> list[tuple[int, str]]:
    """(repetition, row) in run order."""
    order = []
    for r in range(reps):
        order += [(r, n) for n in (names if r % 2 == 0 else list(reversed(names)))]
    return order


def ratio(
    values: list[float], base: list[float]
) -> tuple[float | None, float | None, float | None]:
    """(median / median, min and max of the per-repetition ratios) of ``values`` to
    ``base``, repetition i paired with repetition i; Nones where either is empty."""
    paired = [v / b for v, b in zip(values, base) if b > 0]
    if not values or not base or not paired:
        return None, None, None
    return statistics.median(values) / statistics.median(base), min(paired), max(paired)


def max_loss_diff(losses: list[list[float]], reference: list[float]) -> float:
    """Largest |loss - reference| over every step of every repetition; NaN if a loss
    is NaN, inf if a repetition has a different number of steps."""
    worst = 0.0
    for run in losses:
        if len(run) != len(reference):
            return float("inf")
        for a, b in zip(run, reference):
            d = abs(a - b)
            if math.isnan(d):
                return math.nan
            worst = max(worst, d)
    return worst


def _verdict(runs: Runs, diff: float | None, tol: float) -> str:
    if runs.error:
        return f"failed: {runs.error}"
    if diff is None:
        return "no reference"
    if math.isnan(diff) or diff > tol:
        return f"WRONG (loss off by {diff:.2e} > {tol:.0e})"
    return "ok"


def summarize(
    rows: dict[str, Runs], *, baseline: str, reference: str, tol: float = 1e-5
) -> list[Summary]:
    """One Summary per row, in the given order."""
    ref = rows.get(reference)
    ref_losses = ref.losses[0] if ref is not None and ref.losses else None
    base = rows[baseline].tokens_per_s if baseline in rows else []
    out = []
    for name, runs in rows.items():
        values = runs.tokens_per_s
        diff = max_loss_diff(runs.losses, ref_losses) if ref_losses and runs.losses else None
        mid, low, high = ratio(values, base)
        out.append(
            Summary(
                name=name,
                median=statistics.median(values) if values else None,
                low=min(values) if values else None,
                high=max(values) if values else None,
                ratio=mid,
                ratio_low=low,
                ratio_high=high,
                max_loss_diff=diff,
                verdict=_verdict(runs, diff, tol),
            )
        )
    return out
