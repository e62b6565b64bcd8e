"""Traced plans of deep built-in models from shallow traces: what lets the recommender
search the layouts of a 94-layer mixture-of-experts model in minutes, not hours.

[Note: depth extrapolation]
The built-in models' blocks are identical, so each quantity of a traced step that
grows with depth grows by the same bytes per block: a block's sharded states, its
saved activations, its gradients. The recommender's search traces its candidates (the
MoE presets are traced: [Note: planning any model]) at 4 and 5 blocks instead of all
of them and extends the line through the two to the model's depth, per phase and per
category of the peak's breakdown. qwen3-30b-a3b at ep 8 on 64 H100s, full AC, micro-
batch 1: the 48-block trace (56 s) and the line through 3, 4 and 5 blocks (7 s) gave
the same peak to the byte (each block 155,780,716 bytes more). The line misses a
point of the step that grows faster and overtakes the shallow traces' peak only
deeper (a phase's start holding every block's saved activations, while the shallow
peak sits at its end beside more buffers): qwen3-235b-a22b at ep 8 on 256 H100s,
full AC, micro-batch 4, read 29.06 GiB on the line and 35.53 GiB traced whole. So
the line only ranks candidates: the one the search picks is traced at full depth
before it is returned, and the next is tried where it does not fit then
(fsdpkit.planner.search.recommend); ``fsdpkit plan`` always traces at full depth.
"""

from __future__ import annotations

from dataclasses import replace

from fsdpkit.config import RunConfig, with_changes
from fsdpkit.planner.shapes.result import MemoryPlan, PeakPoint
from fsdpkit.planner.shapes.scenario import Scenario, scenario

DEPTHS = (4, 5)
"""Block counts traced to extrapolate from."""


def extrapolates(cfg: RunConfig, sc: Scenario) -> bool:
    """Whether ``sc`` is a built-in model deep enough to gain from extrapolation."""
    builtin = not (cfg.model.hf or cfg.model.factory)
    return builtin and sc.model is not None and sc.model.n_layers > DEPTHS[-1]


def _shallow(cfg: RunConfig, sc: Scenario, depth: int) -> tuple[RunConfig, Scenario]:
    shallow = with_changes(cfg, {"model.n_layers": depth}, source="the planner")
    planned = scenario(
        shallow,
        world_size=sc.dims.world,
        device=sc.device,
        ranks_per_node=sc.ranks_per_node,
        vocab_size=sc.vocab_size,
    )
    return shallow, replace(planned, accum_sync=sc.accum_sync, accum_auto=False)


def extrapolated_memory(cfg: RunConfig, sc: Scenario) -> MemoryPlan:
    """The traced plan of ``sc`` at its depth on the line through traces at ``DEPTHS``
    blocks ([Note: depth extrapolation]); where another phase than the shallow traces'
    peaks deeper, that phase's peak without a breakdown."""
    from fsdpkit.planner.traced.trace import traced_memory

    plans = [traced_memory(*_shallow(cfg, sc, d)) for d in DEPTHS]
    n = sc.model.n_layers if sc.model is not None else DEPTHS[-1]
    phases = _line(n, [p.phase_peaks for p in plans])
    breakdown = _line(n, [p.peak.breakdown for p in plans])
    last = plans[-1]
    phase = max(phases, key=lambda k: phases[k])
    if phase == last.peak.phase:
        peak = PeakPoint(phases[phase], phase, last.peak.where, breakdown)
    else:
        peak = PeakPoint(phases[phase], phase, "", {})
    note = (
        f"traced at {', '.join(map(str, DEPTHS))} blocks and extended to {n} ([Note: depth "
        "extrapolation] in fsdpkit.planner.traced.depth)"
    )
    return replace(
        last, peak=peak, phase_peaks=phases, model_states=_states(sc), notes=(*last.notes, note)
    )


def _line(n: int, points: list[dict[str, int]]) -> dict[str, int]:
    """Each key's value at depth ``n`` on the line through ``points`` (at ``DEPTHS``)."""
    first, last = points
    step = DEPTHS[1] - DEPTHS[0]
    return {k: v + (n - DEPTHS[1]) * (v - first.get(k, 0)) // step for k, v in last.items()}


def _states(sc: Scenario) -> dict[str, int]:
    from fsdpkit.planner.shapes.states import model_states

    return model_states(sc)
