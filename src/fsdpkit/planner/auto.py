"""``parallel.auto``: the planner picks the parallel settings of a run before launch.

``fsdpkit.config.resolve`` calls ``auto_changes`` once per process (launcher and every
worker); the recommendation is deterministic, so all agree. The device is
``parallel.device_mem`` when set, else the local GPU, else this machine's memory shared
by the local ranks.
"""

from __future__ import annotations

from typing import Any

from fsdpkit.config import RunConfig
from fsdpkit.devices import Device, cpu_device, detected_device, parse_device
from fsdpkit.errors import UserError
from fsdpkit.planner.api import DEFAULT_MARGIN, decide_accum_sync, usable_bytes
from fsdpkit.planner.recommend import recommend
from fsdpkit.planner.scenario import scenario


def auto_device(cfg: RunConfig, *, local_world_size: int) -> Device:
    """The device ``parallel.auto`` plans for (see the module docstring)."""
    if cfg.parallel.device_mem:
        return parse_device(cfg.parallel.device_mem, what="parallel.device_mem")
    return detected_device() or cpu_device(ranks=local_world_size)


def auto_changes(cfg: RunConfig, *, world_size: int, local_world_size: int) -> dict[str, Any]:
    """The recommended config keys (dotted) for ``world_size`` ranks."""
    rec = recommend(
        cfg,
        world_size=world_size,
        device=auto_device(cfg, local_world_size=local_world_size),
        ranks_per_node=local_world_size,
    )
    if rec.best is None:
        raise UserError(
            f"parallel.auto: no configuration of this model fits on {world_size} ranks of this "
            "device. Run `fsdpkit plan --recommend` with the same config to see the closest "
            "ones, then add ranks, use a bigger device, or shrink the batch or sequence."
        )
    return dict(rec.best.changes)


def accum_sync_choice(cfg: RunConfig, *, world_size: int, local_world_size: int) -> str:
    """``parallel.accum_sync = auto`` for a run ([Note: accum_sync auto]): decided
    against the budget of ``parallel.device_mem`` or, with ``parallel.auto``, the device
    it plans for; ``last`` without a budget, or for a model the planner cannot plan
    (a factory or Hugging Face model)."""
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
