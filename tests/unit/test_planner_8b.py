"""Llama 3 8B: the analytic and traced planners agree at 8 and 64 ranks.

The traced plan runs the whole 8B model's step under FakeTensorMode (~10-25 s per
plan on 2 cores), hence ``slow``; how long it takes is measured by
``bench/plan_speed.py``, not asserted here.
"""

from __future__ import annotations

import pytest

from fsdpkit.config import load
from fsdpkit.planner import parse_device, plan

pytestmark = pytest.mark.slow

AGREEMENT = {8: 0.015, 64: 1e-4}
"""Relative bound on traced vs analytic peak. Measured 2026-12-01: +1.38% at 8 ranks
(19.22 vs 18.96 GB), +2e-7 at 64 ranks (docs/planner.md states both)."""


@pytest.mark.parametrize("world", [8, 64])
def test_llama3_8b_analytic_matches_traced(world: int) -> None:
    cfg = load(
        None,
        [
            "model.preset=llama3-8b", "data.seq_len=2048", "train.micro_batch_size=1",
            "activations.mode=full",
        ],
    )  # fmt: skip
    traced = plan(cfg, world_size=world, device=parse_device("h100"), trace=True)
    assert traced.other is not None
    error = (traced.memory.peak.bytes - traced.other.peak.bytes) / traced.other.peak.bytes
    assert abs(error) <= AGREEMENT[world], (world, f"traced vs analytic {error:+.4%}")
