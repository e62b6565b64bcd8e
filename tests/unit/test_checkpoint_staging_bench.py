"""bench/checkpoint_staging.py's design and verdict rule: the orders balance carry-over
between rows, and the verdict keeps fsdpkit's stager only beyond the A/A control."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import checkpoint_staging as bench


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_williams_orders_balance_first_places_and_successors(n: int) -> None:
    orders = bench.williams(n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    firsts = Counter(o[0] for o in orders)
    pairs = Counter((o[i], o[i + 1]) for o in orders for i in range(n - 1))
    assert set(firsts) == set(range(n)) and len(set(firsts.values())) == 1
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1


def _rows(control: tuple[float, float, float], dcp: tuple[float, float, float]) -> dict:
    shm = (dcp[0] + 1, dcp[1] + 1, dcp[2] + 1)  # slower by median: not the one adopted
    return {
        "control": {"blocking_ratio": control},
        "dcp": {"blocking_ratio": dcp},
        "dcp_shm": {"blocking_ratio": shm},
    }


def test_verdict_keeps_ours_only_beyond_the_control() -> None:
    keep = bench.verdict(_rows((0.9, 1.0, 1.1), (1.2, 1.5, 1.8)))
    assert keep.startswith("fsdpkit's Stager wins") and "kept (cached):" in keep
    overlap = bench.verdict(_rows((0.9, 1.0, 1.3), (1.2, 1.5, 1.8)))
    assert overlap.startswith("DCP DefaultStager, kept (cached) is as good")
