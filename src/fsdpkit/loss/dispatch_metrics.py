"""A step's metrics of a mixture-of-experts model's token dispatch: the assignments a
capacity dropped and the busiest expert-parallel rank's load, each a collective over
every rank ([Note: token dispatch] and [Note: routing imbalance] in
fsdpkit.sharding.experts.dispatch). The router loss reports them with its own
(fsdpkit.loss.router), and so does a pipelined run, whose stages each hold some of the
dispatches (fsdpkit.sharding.pipeline.routing)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class DispatchMetrics:
    """The dispatches of ``model``'s routed experts modules, read once a step."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        found = (getattr(m, "expert_dispatch", None) for m in model.modules())
        dispatches = [d for d in found if d is not None]
        self.capacity: list[Any] = [d for d in dispatches if d.capacity_factor]
        self.ep: list[Any] = [d for d in dispatches if d.group is not None]

    def step_metrics(self) -> dict[str, Any]:
        """``moe_dropped`` with a capacity and ``moe_imbalance`` under ep (collectives:
        every rank calls this once a step); resets what the dispatches counted."""
        return self._dropped() | self._imbalance()

    def _dropped(self) -> dict[str, Any]:
        """``moe_dropped`` (share of the step's assignments) and their count, every rank
        and layer summed; {} without a capacity."""
        if not self.capacity:
            return {}
        counts = [c for d in self.capacity if (c := d.drops()) is not None]
        total = torch.stack(counts).sum(0) if counts else torch.zeros(2)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        dropped, routed = (float(v) for v in total)
        return {"moe_dropped": dropped / max(routed, 1.0), "moe_dropped_assignments": int(dropped)}

    def _imbalance(self) -> dict[str, Any]:
        """``moe_imbalance`` and ``moe_imbalance_layer_max`` of the step ([Note: routing
        imbalance] in fsdpkit.sharding.experts.dispatch): the busiest rank's, a collective
        (a max over the ranks); {} without expert parallelism."""
        if not self.ep:
            return {}
        loads = [x for d in self.ep if (x := d.loads()) is not None]
        mean, peak = rank_imbalance(loads)
        device = next(self.ep[0].module.parameters()).device
        both = torch.tensor([mean, peak], dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
        return {
            "moe_imbalance": round(float(both[0]), 4),
            "moe_imbalance_layer_max": round(float(both[1]), 4),
        }


def rank_imbalance(loads: list[tuple[float, float]]) -> tuple[float, float]:
    """(mean over the MoE layers, largest) received / balanced rows of one rank, from
    each layer's (mean, largest) over its calls; (0, 0) without calls (a rank that
    routed nothing: the max over ranks ignores it)."""
    if not loads:
        return 0.0, 0.0
    return sum(m for m, _ in loads) / len(loads), max(p for _, p in loads)
