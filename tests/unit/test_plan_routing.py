"""The routing a plan of a MoE model under expert parallelism assumes ([Note: routing in
the plan]): the pure rules, the dispatch's per-rank record, and the trace at a routing."""

from __future__ import annotations

import math

import pytest
import torch

from fsdpkit.config import load
from fsdpkit.loss.dispatch_metrics import rank_imbalance
from fsdpkit.planner import plan
from fsdpkit.planner.errors import PlanError
from fsdpkit.planner.experts.routing import (
    BALANCED,
    Routing,
    call_loads,
    from_records,
    layer_loads,
    received_rows,
    uniform,
)
from fsdpkit.sharding.experts.dispatch import ExpertDispatch

TINY = [
    "model.preset=moe-tiny", "data.seq_len=32", "train.micro_batch_size=2",
    "precision.mode=fp32", "parallel.ep=2",
]  # fmt: skip


def test_layer_loads_keep_the_mean_with_the_busiest_layer_first() -> None:
    loads = layer_loads(Routing(1.1, 1.3), layers=3)
    assert loads[0] == 1.3 and loads[1] == loads[2]
    assert math.isclose(sum(loads) / 3, 1.1)
    assert layer_loads(Routing(1.2, 1.2), layers=4) == [1.2] * 4
    assert layer_loads(Routing(1.0, 5.0), layers=2) == [5.0, 0.0]  # never below zero
    assert layer_loads(Routing(1.4, 1.4), layers=1) == [1.4]
    # a recorded rank's own loads are replayed as they are
    assert layer_loads(Routing(1.0, 1.2, by_layer=(0.8, 1.2)), layers=2) == [0.8, 1.2]
    with pytest.raises(PlanError, match="a routing of 2 MoE layers cannot be planned"):
        layer_loads(Routing(1.0, 1.2, by_layer=(0.8, 1.2)), layers=3)


def test_call_loads_give_each_dispatch_of_a_layer_its_recorded_load() -> None:
    assert call_loads(Routing(1.2, 1.2), layers=2) == ((1.2,), (1.2,))  # every call
    replay = Routing(by_call=((0.9, 1.3), (1.0, 1.1)))  # a pipeline's 2 micro-batches
    assert call_loads(replay, layers=2) == ((0.9, 1.3), (1.0, 1.1))
    with pytest.raises(PlanError, match="a routing of 2 MoE layers cannot be planned"):
        call_loads(replay, layers=4)


def test_received_rows_round_up_and_stop_at_the_capacity() -> None:
    assert received_rows(assignments=512, load=1.0, capacity_rows=None) == 512
    assert received_rows(assignments=512, load=1.102, capacity_rows=None) == 565
    assert received_rows(assignments=512, load=1.5, capacity_rows=640) == 640


def test_a_number_and_a_run_s_median_step() -> None:
    assert uniform(1.25) == Routing(1.25, 1.25, "--moe-imbalance 1.25")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(PlanError, match="must be a positive number"):
            uniform(bad)
    records = [
        {"step": 0, "data": {}},
        {"step": 1, "moe_imbalance": 1.1, "moe_imbalance_layer_max": 1.3},
        {"step": 2, "moe_imbalance": 1.3, "moe_imbalance_layer_max": 1.9},
        {"step": 3, "moe_imbalance": 1.05, "moe_imbalance_layer_max": 1.2},
    ]
    routing = from_records(records, source="runs/a")
    assert (routing.mean, routing.peak) == (1.1, 1.3)
    assert "median of 3 steps of runs/a" in routing.describe()
    with pytest.raises(PlanError, match="has no moe_imbalance record"):
        from_records(records[:1], source="runs/b")
    assert BALANCED.balanced and "balanced step" in BALANCED.describe()


def test_a_rank_s_loads_over_its_layers() -> None:
    assert rank_imbalance([(1.0, 1.2), (1.2, 1.4)]) == (1.1, 1.4)
    assert rank_imbalance([]) == (0.0, 0.0)


def test_the_dispatch_records_received_over_balanced_rows() -> None:
    """One rank's record from the counts it received ([Note: routing imbalance]), per
    training call; a forward in eval mode records nothing."""
    module = torch.nn.Linear(2, 2)
    dispatch = ExpertDispatch(module, experts=4, group=None, capacity_factor=None)
    dispatch._loads += [600 / 512, 424 / 512, 600 / 512]  # as _exchange appends them
    assert dispatch.loads(reset=False) == dispatch.loads(reset=False)  # a peek
    mean, peak = dispatch.loads() or (0, 0)
    assert math.isclose(mean, 1624 / 1536) and peak == 600 / 512
    assert dispatch.loads() is None  # reset


def test_the_trace_routes_the_given_imbalance() -> None:
    cfg = load(None, TINY)
    balanced = plan(cfg, world_size=4, trace=True)
    busier = plan(cfg, world_size=4, trace=True, routing=uniform(1.5))
    busiest = plan(cfg, world_size=4, trace=True, routing=uniform(2.0))
    peaks = [p.memory.peak.bytes for p in (balanced, busier, busiest)]
    assert peaks[0] < peaks[1] < peaks[2]
    assert "planned routing: a balanced step" in "\n".join(balanced.scenario.notes)
    assert "receives 1.5x its balanced rows in every layer" in "\n".join(busier.scenario.notes)
    # a capacity caps what a rank receives: far past it, the plan is the capacity's bound
    capped = load(None, [*TINY, "model.capacity_factor=1.25"])
    bound = plan(capped, world_size=4, trace=True).memory.peak.bytes
    assert plan(capped, world_size=4, trace=True, routing=uniform(3.0)).memory.peak.bytes == bound


def test_an_imbalance_without_ep_is_refused() -> None:
    with pytest.raises(PlanError, match=r"no parallel\.ep > 1"):
        plan(load(None, TINY[:-1]), world_size=4, trace=True, routing=uniform(1.5))


def test_the_recommender_plans_its_ep_options_at_the_routing() -> None:
    """``--recommend --moe-imbalance``: options with ep > 1 are planned at the routing
    given, those without ep are what they are whatever the routing."""
    from fsdpkit.devices import device_from
    from fsdpkit.planner.search.recommend import recommend

    cfg = load(None, TINY)
    device = device_from(name=None, memory="2GiB")

    def peaks(routing: Routing) -> dict[tuple[object, ...], tuple[int, int]]:
        rec = recommend(cfg, world_size=4, device=device, routing=routing)
        return {
            tuple(sorted(c.changes.items())): (c.config.parallel.ep, c.plan.memory.peak.bytes)
            for c in rec.ranked
        }

    balanced, busier = peaks(BALANCED), peaks(uniform(1.6))
    both = set(balanced) & set(busier)
    assert {balanced[k][0] for k in both} >= {1, 2}, (balanced, busier)
    for key in both:
        ep, peak = balanced[key]
        assert busier[key][1] > peak if ep > 1 else busier[key][1] == peak
