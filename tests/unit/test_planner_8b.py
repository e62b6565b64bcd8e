"""Llama 3 8B: the analytic and traced planners agree at 8 and 64 ranks.

The traced plan runs the whole 8B model's step under FakeTensorMode (~20-25 s per
plan on 2 cores), hence ``slow``; the issue's bound is 3 minutes at 64 ranks.
"""

from __future__ import annotations

import time

import pytest

from fsdpkit.config import load
from fsdpkit.planner import parse_device, plan

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world", [8, 64])
def test_llama3_8b_analytic_matches_traced(world: int) -> None:
    cfg = load(
        None,
        [
            "model.preset=llama3-8b", "data.seq_len=2048", "train.micro_batch_size=1",
            "activations.mode=full",
        ],
    )  # fmt: skip
    start = time.perf_counter()
    traced = plan(cfg, world_size=world, device=parse_device("h100"), trace=True)
    elapsed = time.perf_counter() - start
    assert traced.other is not None
    assert traced.memory.peak.bytes == pytest.approx(traced.other.peak.bytes, rel=0.10)
    assert elapsed < 180
