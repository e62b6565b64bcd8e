"""The routing a plan of a mixture-of-experts model under expert parallelism assumes.

[Note: routing in the plan]
Under ``parallel.ep`` a rank computes the rows the whole ep group routed to its
experts, and the router (its weights and the data) decides how many: a config alone
does not say. The plan traces a balanced step unless told otherwise (each rank
receives its own tokens x top_k rows per layer: [Note: expert parallelism in the plan]
in fsdpkit.planner.traced.fake_patches). A training run under ep records how far from that
its busiest rank was ([Note: routing imbalance] in fsdpkit.sharding.experts.dispatch):
``moe_imbalance`` (its received rows over the MoE layers / balanced) and
``moe_imbalance_layer_max`` (its busiest layer's), per step in metrics.jsonl.
``fsdpkit plan --moe-imbalance`` takes a number (every layer at it) or such a run
directory (the median step of each: the typical step the plan targets).

Two numbers, because the two ways a step holds routed rows follow different ones:
without checkpointing every layer's saved rows are live when the backward starts (the
rank's sum over layers: the mean), with it one recomputed layer's are, on top of what
the backward has accumulated (its busiest layer: the max). The trace routes the
busiest layer first and the others at the load that keeps the mean: the first block's
backward is the last, where the most gradients are held, so that is where a busy
layer costs most. Measured on bench/plan_accuracy.py's "E" rows (2 and 4 gloo ranks):
the busiest rank received 1.03-1.12x its balanced rows over the step, 1.10-1.24x in
its busiest layer (1.7x in one step); planned balanced the rows were 0.3-3.6% below
the typical step, planned at their own run's routing within 0.3%.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fsdpkit.planner.errors import PlanError

MEAN_KEY = "moe_imbalance"
PEAK_KEY = "moe_imbalance_layer_max"


@dataclass(frozen=True)
class Routing:
    """Received rows of the planned rank / balanced rows ([Note: routing in the plan])."""

    mean: float = 1.0
    """Over the MoE layers (1.0: balanced)."""
    peak: float = 1.0
    """In the busiest layer (>= mean)."""
    source: str = ""
    """Where the numbers come from, as the plan's note says it ("" : the default)."""
    by_layer: tuple[float, ...] = ()
    """One rank's own load of each MoE layer in forward order, as a run recorded them
    (bench/moe_routing_replay.py replays them; empty: from ``mean`` and ``peak``)."""
    by_call: tuple[tuple[float, ...], ...] = ()
    """One rank's own load of each MoE layer at each of its dispatches in one step, in
    order (a pipeline's micro-batches differ: bench/plan_pipeline_moe.py replays a
    recorded step; empty: one load per layer)."""

    @property
    def balanced(self) -> bool:
        return self.mean == 1.0 and self.peak == 1.0

    def describe(self) -> str:
        if self.balanced and not self.source:
            return "a balanced step (each rank receives its own tokens x top_k rows per layer)"
        at = (
            f"{self.mean:.4g}x its balanced rows in every layer"
            if self.mean == self.peak
            else f"{self.mean:.4g}x its balanced rows over the layers, {self.peak:.4g}x in "
            "its busiest (traced first)"
        )
        return f"{at} ({self.source})" if self.source else at


BALANCED = Routing()


def uniform(value: float) -> Routing:
    """Every layer at ``value`` x its balanced rows (``--moe-imbalance X``)."""
    if not (value > 0 and math.isfinite(value)):
        raise PlanError(
            f"--moe-imbalance {value}: the busiest ep rank's received rows / balanced rows "
            "must be a positive number (1.0 = balanced routing, 1.3 = 30% more rows), "
            "or a run directory whose metrics.jsonl recorded it."
        )
    return Routing(value, value, f"--moe-imbalance {value:g}")


def from_records(records: Iterable[dict[str, Any]], *, source: str) -> Routing:
    """The median logged step's ``moe_imbalance`` and ``moe_imbalance_layer_max`` of a
    run's metrics records (``source`` names the run for the note and the error)."""
    steps = [r for r in records if isinstance(r.get(MEAN_KEY), int | float)]
    if not steps:
        raise PlanError(
            f"--moe-imbalance {source}: its metrics.jsonl has no {MEAN_KEY} record. A "
            "run records it per step when it trains a mixture-of-experts model with "
            "parallel.ep > 1; pass such a run's directory, or a number (1.0 = balanced)."
        )
    mean = statistics.median(float(r[MEAN_KEY]) for r in steps)
    peak = statistics.median(float(r.get(PEAK_KEY, r[MEAN_KEY])) for r in steps)
    return Routing(mean, max(peak, mean), f"median of {len(steps)} steps of {source}")


def layer_loads(routing: Routing, *, layers: int) -> list[float]:
    """Each MoE layer's received / balanced rows, in forward order: the busiest first,
    the others at the load that keeps the mean ([Note: routing in the plan])."""
    if routing.by_layer:
        if len(routing.by_layer) != layers:
            raise PlanError(
                f"a routing of {len(routing.by_layer)} MoE layers cannot be planned on a "
                f"model of {layers}: plan the model the routing was recorded on."
            )
        return list(routing.by_layer)
    if layers <= 1:
        return [routing.peak] * layers
    rest = max(0.0, (layers * routing.mean - routing.peak) / (layers - 1))
    return [routing.peak] + [rest] * (layers - 1)


def call_loads(routing: Routing, *, layers: int) -> tuple[tuple[float, ...], ...]:
    """Each MoE layer's loads of its dispatches in a step, in forward order (one load
    per layer, for all its dispatches, unless ``routing.by_call``)."""
    if not routing.by_call:
        return tuple((load,) for load in layer_loads(routing, layers=layers))
    if len(routing.by_call) != layers:
        raise PlanError(
            f"a routing of {len(routing.by_call)} MoE layers cannot be planned on a "
            f"model of {layers}: plan the model the routing was recorded on."
        )
    return routing.by_call


def received_rows(*, assignments: int, load: float, capacity_rows: int | None) -> int:
    """Rows a rank receives in one layer at ``load`` x its balanced ``assignments``,
    at most the capacity's ``capacity_rows`` (E x C) where a capacity factor is set."""
    rows = math.ceil(load * assignments - 1e-9)
    return rows if capacity_rows is None else min(rows, capacity_rows)
