"""``parallel.auto``: the planner picks the parallel settings of a run before launch.

``fsdpkit.run.resolve`` calls ``auto_plan`` once per process (launcher and every
worker); the recommendation is deterministic, so all agree. It may set
``parallel.tp`` / ``parallel.cp`` too ([Note: layout search] in fsdpkit.planner.search.layouts)
when FSDP alone does not fit. The device is
``parallel.device_mem`` when set, else the local GPU, else this machine's memory shared
by the local ranks. A model the planner cannot plan (its code fails under fake
tensors, say) keeps its configured settings, and the note says why; only a model that
was planned and fits nowhere is an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from fsdpkit.config import RunConfig
from fsdpkit.devices import Device, cpu_device, detected_device, parse_device
from fsdpkit.errors import UserError
from fsdpkit.planner.api import DEFAULT_MARGIN, decide_accum_sync, usable_bytes
from fsdpkit.planner.errors import TraceError
from fsdpkit.planner.search.recommend import recommend
from fsdpkit.planner.shapes.scenario import scenario

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoPlan:
    """What ``parallel.auto`` decided."""

    changes: dict[str, Any] = field(default_factory=dict)
    """Dotted keys to set (empty: keep the config as given)."""
    note: str | None = None
    """Why nothing was planned (the run keeps its settings), or None."""


def auto_device(cfg: RunConfig, *, local_world_size: int) -> Device:
    """The device ``parallel.auto`` plans for (see the module docstring)."""
    if cfg.parallel.device_mem:
        return parse_device(cfg.parallel.device_mem, what="parallel.device_mem")
    return detected_device() or cpu_device(ranks=local_world_size)


def auto_plan(cfg: RunConfig, *, world_size: int, local_world_size: int) -> AutoPlan:
    """The recommended config keys (dotted) for ``world_size`` ranks, or a note saying
    what could not be planned."""
    device = auto_device(cfg, local_world_size=local_world_size)
    try:
        rec = recommend(
            cfg, world_size=world_size, device=device, ranks_per_node=local_world_size, top=1
        )
    except TraceError as exc:  # the user's model code failed under fake tensors
        log.debug("parallel.auto: planning failed", exc_info=True)
        return AutoPlan(note=_unplanned(cfg, exc))
    if rec.best is None:
        raise UserError(
            f"parallel.auto: no configuration of this model fits on {world_size} ranks of "
            f"{device.name}. Run `fsdpkit plan --recommend` with the same config to see the "
            "closest ones, then add ranks, use a bigger device, or shrink the batch or sequence."
        )
    return AutoPlan(changes=dict(rec.best.changes))


def _unplanned(cfg: RunConfig, exc: TraceError) -> str:
    model = (
        f"model.hf = {cfg.model.hf!r}" if cfg.model.hf else f"model.factory = {cfg.model.factory!r}"
    )
    return (
        f"parallel.auto could not plan {model}: {exc} The run keeps its configured "
        "parallel settings."
    )


def auto_changes(cfg: RunConfig, *, world_size: int, local_world_size: int) -> dict[str, Any]:
    """The recommended config keys only (see ``auto_plan``)."""
    return auto_plan(cfg, world_size=world_size, local_world_size=local_world_size).changes


def accum_sync_choice(cfg: RunConfig, *, world_size: int, local_world_size: int) -> str:
    """``parallel.accum_sync = auto`` for a run ([Note: accum_sync auto]): decided
    against the budget of ``parallel.device_mem`` or, with ``parallel.auto``, the device
    it plans for; ``last`` without a budget, or for a model the analytic planner cannot
    plan (no trace at every launch: [Note: planning any model])."""
    if cfg.parallel.accum_sync != "auto":
        return cfg.parallel.accum_sync
    if not (cfg.parallel.device_mem or cfg.parallel.auto):
        return "last"
    device = auto_device(cfg, local_world_size=local_world_size)
    try:
        sc = scenario(cfg, world_size=world_size, device=device, ranks_per_node=local_world_size)
    except UserError:
        return "last"
    usable = usable_bytes(device, margin=DEFAULT_MARGIN)
    return decide_accum_sync(sc, usable=usable).accum_sync
