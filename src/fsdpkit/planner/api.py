"""``plan()``: the planner's entry point — memory, traffic and a fit verdict."""

from __future__ import annotations

import time

from fsdpkit.config import RunConfig
from fsdpkit.devices import Device
from fsdpkit.planner.analytic import analytic_memory, sizes
from fsdpkit.planner.blockmem import loss_buffer_peak
from fsdpkit.planner.comm import comm_volume
from fsdpkit.planner.result import LossBuffers, MemoryPlan, Plan
from fsdpkit.planner.scenario import PlanError, Scenario, scenario

DEFAULT_MARGIN = 0.10
"""Share of device memory kept free: allocator fragmentation and what no model sees
(the caching allocator typically reserves 5-15% above what tensors use)."""


def usable_bytes(device: Device, *, margin: float) -> int | None:
    """Memory tensors may use: device memory minus the runtime reserve and the margin."""
    if device.memory is None:
        return None
    return int((device.memory - device.runtime_reserve) * (1.0 - margin))


def plan_scenario(
    sc: Scenario, *, cfg: RunConfig | None = None, trace: bool = False, margin: float
) -> Plan:
    """Plan an already resolved scenario (``cfg`` is needed for ``trace``)."""
    if not 0.0 <= margin < 1.0:
        raise PlanError(f"--margin must be in [0, 1), got {margin}.")
    start = time.perf_counter()
    other: MemoryPlan | None = None
    if trace:
        if cfg is None:
            raise PlanError("traced planning needs the RunConfig (pass cfg=...)")
        from fsdpkit.planner.traced import traced_memory  # imports torch's fake machinery

        memory = traced_memory(cfg, sc)
        other = analytic_memory(sc) if sc.layout.decoder_blocks else None
    else:
        memory = analytic_memory(sc)
    usable = usable_bytes(sc.device, margin=margin)
    return Plan(
        scenario=sc,
        memory=memory,
        comm=comm_volume(sc),
        device_bytes=sc.device.memory,
        usable_bytes=usable,
        margin=margin,
        fits=None if usable is None else memory.peak.bytes <= usable,
        elapsed_s=time.perf_counter() - start,
        other=other,
        loss=loss_buffers(sc),
    )


def loss_buffers(sc: Scenario) -> LossBuffers:
    """Logits and loss buffers of ``sc``'s loss mode, and of full logits."""
    s = sizes(sc)
    chosen = loss_buffer_peak(s, chunk=sc.loss_chunk)
    full = loss_buffer_peak(s, chunk=None) if sc.loss_chunk is not None else chosen
    return LossBuffers(chunk=sc.loss_chunk, chosen=chosen, full=full)


def plan(
    cfg: RunConfig,
    *,
    world_size: int,
    device: Device | None = None,
    trace: bool = False,
    margin: float = DEFAULT_MARGIN,
    ranks_per_node: int = 8,
    vocab_size: int | None = None,
) -> Plan:
    """Per-rank memory and traffic of training ``cfg`` on ``world_size`` ranks.

    ``device`` (see ``devices.parse_device``) gives the memory to fit in and how
    ``precision.mode = auto`` resolves; ``trace`` runs the real model code on a fake
    process group instead of the formulas (seconds to minutes, no devices needed);
    ``vocab_size`` is the tokenizer's when the config leaves model.vocab_size empty.
    """
    sc = scenario(
        cfg,
        world_size=world_size,
        device=device,
        ranks_per_node=ranks_per_node,
        vocab_size=vocab_size,
    )
    return plan_scenario(sc, cfg=cfg, trace=trace, margin=margin)
