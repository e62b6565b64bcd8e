"""The planner under expert parallelism (issue 37): experts units, the dispatch's
traffic, the traced plan at ep (balanced routing, the capacity bound), the depth
extrapolation the recommender searches with, and ep in the recommender's grid.

The measured side is bench/plan_accuracy.py's "E" rows (tests/distributed/
test_planner_accuracy.py pins one)."""

from __future__ import annotations

from dataclasses import replace

from fsdpkit.config import load
from fsdpkit.devices import Device
from fsdpkit.planner import plan, recommend
from fsdpkit.planner.experts.parallel import dispatch_bytes
from fsdpkit.planner.shapes.scenario import scenario
from fsdpkit.planner.traced.depth import extrapolated_memory
from fsdpkit.planner.traced.trace import traced_memory

TINY = [
    "model.preset=moe-tiny",
    "data.seq_len=32",
    "train.micro_batch_size=2",
    "precision.mode=fp32",
]
WIDE = [  # experts dominate: 16 experts of d=256, few tokens
    "model.preset=moe-tiny", "model.dim=256", "model.n_heads=4", "model.n_kv_heads=2",
    "model.experts=16", "model.top_k=2", "model.vocab_size=512", "data.seq_len=16",
    "train.micro_batch_size=1", "precision.mode=fp32",
]  # fmt: skip


def test_experts_units_split_the_routed_parameters_over_ep() -> None:
    without = scenario(load(None, TINY), world_size=4)
    sc = scenario(load(None, [*TINY, "parallel.ep=2"]), world_size=4)
    assert not without.expert_units and sc.dims.ep == 2 and len(sc.expert_units) == 2
    routed = 4 * 3 * 64 * 32  # experts x (gate, up, down) x d x f, one block
    experts = sc.expert_units[0]
    assert experts.numel == routed // 2  # this ep rank's 2 of 4 experts
    assert experts.sharded == routed // 2 // 2  # over the shard group's 2 other ranks
    assert sum(u.numel for u in sc.units) + 2 * routed == sum(u.numel for u in without.units)
    # each rank stores E / shard of the experts with and without ep
    states = [sum(u.sharded for u in s.all_units) for s in (without, sc)]
    assert states[0] == states[1]


def test_the_dispatch_traffic_and_the_smaller_gathers() -> None:
    assert dispatch_bytes(layers=2, tokens=64, top_k=2, dim=64, ep=2, e=4, checkpointed=0) == (
        8 * 64 * 64 * 4,
        8 + 2,
    )
    assert dispatch_bytes(layers=2, tokens=64, top_k=2, dim=64, ep=1, e=4, checkpointed=2) == (0, 0)
    ep1 = plan(load(None, TINY), world_size=4, trace=True)
    ep2 = plan(load(None, [*TINY, "parallel.ep=2"]), world_size=4, trace=True)
    assert ep1.comm.ep_exchange == 0 and ep2.comm.ep_exchange == 2 * 4 * 128 * 64 * 4 // 2
    assert ep2.comm.all_gather < ep1.comm.all_gather  # a rank gathers half the experts
    notes = "\n".join(ep2.scenario.notes)
    assert "expert parallel 2: each MoE layer sends 128 rows" in notes
    assert "gives that rank 256 rows" in notes
    assert "nothing of it grows with the world" in notes


def test_a_capacity_factor_traces_its_bound() -> None:
    cfg = [*TINY, "parallel.ep=2", "activations.mode=full"]
    balanced = plan(load(None, cfg), world_size=4, trace=True).memory.peak.bytes
    bound = plan(load(None, [*cfg, "model.capacity_factor=2.0"]), world_size=4, trace=True)
    assert bound.memory.peak.bytes > balanced


def test_deep_models_extrapolate_from_shallow_traces() -> None:
    cfg = load(None, [*TINY, "parallel.ep=2", "model.n_layers=7", "activations.mode=full"])
    sc = scenario(cfg, world_size=4)
    whole = traced_memory(cfg, sc)
    line = extrapolated_memory(cfg, sc)
    assert line.peak.bytes == whole.peak.bytes
    assert line.phase_peaks == whole.phase_peaks
    assert any("extended to 7" in n for n in line.notes)


def test_the_recommender_picks_ep_where_fsdp_alone_does_not_fit() -> None:
    cfg = load(None, [*WIDE, "activations.mode=full"])
    peaks = {
        ep: plan(
            load(None, [*WIDE, "activations.mode=full", f"parallel.ep={ep}"]),
            world_size=4,
            trace=True,
        ).memory.peak.bytes
        for ep in (1, 4)
    }
    assert peaks[4] < peaks[1]
    device = Device("test", "cpu", memory=(peaks[1] + peaks[4]) // 2, bf16=False)
    rec = recommend(cfg, world_size=4, device=device, margin=0.0, ranks_per_node=4, top=1)
    assert rec.best is not None, rec
    assert int(rec.best.changes.get("parallel.ep", 1)) > 1  # type: ignore[call-overload]
    assert rec.best.plan.fits and rec.searched > rec.considered
    assert not any("extended to" in n for n in rec.best.plan.memory.notes)  # traced whole
    assert replace(rec.best.plan.scenario).dims.ep == int(rec.best.changes["parallel.ep"])  # type: ignore[call-overload]
