"""The traced planner runs ring attention's own path (parallel.cp_attention = "ring"):
torch's ring functions through fsdpkit's CPU handlers on fake tensors of a fake
process group ([Note: built-in masks under fake tensors] in fsdpkit.planner.traced.fake_patches)."""

from __future__ import annotations

from fsdpkit.config import load
from fsdpkit.planner import plan
from support import PLAN_T

TINY = [*PLAN_T, "precision.mode=fp32", "parallel.cp=2"]


def test_ring_layout_traces_and_holds_more_than_ulysses() -> None:
    # ring keeps every head and all-gathers the key / value (cp x 2 x local kv) and
    # accumulates q / k / v grads in fp32: a dp2 x cp2 step holds more than Ulysses'
    ring = plan(load(None, [*TINY, "parallel.cp_attention=ring"]), world_size=4, trace=True)
    ulysses = plan(load(None, TINY), world_size=4, trace=True)
    assert ring.memory.mode == ulysses.memory.mode == "traced"
    assert ring.memory.peak.bytes > ulysses.memory.peak.bytes


def test_traced_ring_holds_gloos_gather_temporary_as_the_analytic_model() -> None:
    # CPU ranks: gloo's temporary of the k / v gather (cp x 2Q) lives to the first
    # wait in both planners ([Note: ring attention memory], fsdpkit.planner.gloo_buffers);
    # with it the two agree on the ring's buffers (0.01% here), and torch's rotater
    # is itself again after the trace
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _AllGatherRotater,
    )

    exchange = _AllGatherRotater.exchange_buffers
    for ac in ("none", "full"):
        cfg = load(None, [*TINY, "parallel.cp_attention=ring", f"activations.mode={ac}"])
        traced = plan(cfg, world_size=4, trace=True).memory.peak.bytes
        analytic = plan(cfg, world_size=4, trace=False).memory.peak.bytes
        assert abs(traced - analytic) / analytic < 0.001, (ac, traced, analytic)
    assert _AllGatherRotater.exchange_buffers is exchange
