"""Traced pipeline plans ([Note: traced pipeline plans] in
fsdpkit.planner.pipeline.traced): each pipeline rank's stages traced under a fake
process group, one rank at a time. The dense control equals the analytic replay
(itself within 0.01% of real steps: bench/plan_accuracy.py); mixture-of-experts
stages, with ep inside them, are planned per rank; what cannot be traced is refused
with why. The real steps these plans are checked against: bench/plan_pipeline_moe.py."""

from __future__ import annotations

import dataclasses

import pytest

from fsdpkit.config import load
from fsdpkit.devices import parse_device
from fsdpkit.planner import plan, recommend
from fsdpkit.planner.errors import PlanError
from fsdpkit.planner.experts.routing import Routing
from fsdpkit.planner.formatting import format_plan

DENSE = [
    *("model.preset=tiny", "model.dim=128", "model.n_layers=4", "model.n_heads=4"),
    *("model.n_kv_heads=2", "model.ffn_dim=344", "model.vocab_size=1024"),
    *("model.tie_embeddings=false", "data.seq_len=64", "precision.mode=fp32"),
    *("train.micro_batch_size=1", "train.global_batch_size=8", "parallel.pp=2"),
]  # fmt: skip
MOE = [
    *("model.preset=moe-tiny", "model.dim=128", "model.n_layers=4", "model.experts=8"),
    *("model.vocab_size=2048", "data.seq_len=128", "precision.mode=fp32"),
    *("train.micro_batch_size=1", "train.global_batch_size=8", "parallel.pp=2"),
]  # fmt: skip


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_a_traced_pipeline_equals_the_analytic_replay_of_a_dense_model(schedule: str) -> None:
    cfg = load(None, [*DENSE, f"parallel.pp_schedule={schedule}"])
    traced = plan(cfg, world_size=2, trace=True).pipeline
    analytic = plan(cfg, world_size=2).pipeline
    assert traced is not None and analytic is not None
    for t, a in zip(traced.ranks, analytic.ranks, strict=True):
        assert t.memory.mode == "traced" and a.memory.mode == "analytic"
        # the send each warm-up forward keeps and the receive buffers made in the first
        # step are the trace's to count (without them pp rank 0 read one hidden state low)
        assert t.memory.peak.bytes == pytest.approx(a.memory.peak.bytes, rel=1e-3)
        assert t.memory.model_states == a.memory.model_states


def test_a_moe_pipeline_is_planned_rank_by_rank_with_its_experts_in_the_stages() -> None:
    untied = [*MOE, "model.tie_embeddings=false", "parallel.ep=2"]
    p = plan(load(None, untied), world_size=4)
    assert p.pipeline is not None and p.memory.mode == "traced"
    ranks = p.pipeline.ranks
    assert [r.stages for r in ranks] == [(0,), (1,)]
    assert p.memory.peak.bytes == max(r.memory.peak.bytes for r in ranks)
    # each pp rank shards its own 2 blocks' experts over efsdp: half the model's states
    whole = plan(load(None, [*untied, "parallel.pp=1"]), world_size=2)
    params = sum(r.memory.model_states["sharded_params"] for r in ranks)
    assert params == pytest.approx(whole.memory.model_states["sharded_params"], rel=0.01)
    # a recorded routing reaches each rank's own layers: every dispatch at 1.5x its
    # balanced rows, given per layer or per call alike, holds more than balanced
    busy = [
        plan(load(None, untied), world_size=4, routing=r).memory.peak.bytes
        for r in (Routing(by_layer=(1.5,) * 4), Routing(by_call=((1.5, 1.5),) * 4))
    ]
    assert busy[0] == busy[1] > p.memory.peak.bytes
    text = format_plan(p)
    assert "planned by tracing each pipeline rank" in text
    assert "carried across the pipeline stages" in text  # not the gathered logits' note
    assert "pp rank 1: stage 1: blocks 2-3 + norm, head, loss" in text


def test_a_zero_bubble_moe_pipeline_is_refused_with_why() -> None:
    cfg = load(None, [*MOE, "parallel.pp_schedule=ZBVZeroBubble"])
    with pytest.raises(PlanError, match="ZBVZeroBubble splits each backward"):
        plan(cfg, world_size=2)


@pytest.mark.slow  # ~55 s: the recommender traces each pipelined candidate's ranks
def test_the_recommender_may_pick_pp_for_a_moe_model_on_a_slow_network() -> None:
    """Two nodes on a slow link, a MoE model that fits neither whole nor HSDP over a
    node without checkpointing: pp 2 keeps each stage's FSDP inside its node, its
    ranks planned by tracing ([Note: pipeline in the recommender])."""
    cfg = load(None, [
        *("model.preset=moe-tiny", "model.dim=1024", "model.n_layers=8", "model.experts=16"),
        *("model.n_heads=8", "model.n_kv_heads=4", "model.ffn_dim=1024"),
        *("model.vocab_size=8192", "data.seq_len=512", "precision.mode=bf16"),
        *("train.micro_batch_size=1", "train.global_batch_size=64"),
    ])  # fmt: skip
    slow = dataclasses.replace(parse_device("h100"), memory=1524 * 2**20, inter_gbps=0.1)
    rec = recommend(cfg, world_size=16, device=slow, ranks_per_node=8)
    assert rec.best is not None and rec.best.changes.get("parallel.pp") == 2, rec.best.changes
    assert rec.best.plan.pipeline is not None and rec.best.plan.memory.mode == "traced"
