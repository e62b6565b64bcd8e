"""Turning a plain model into a correctly sharded FSDP2 model.

The names below are imported on first use ([Note: lazy package faces] in fsdpkit.lazy):
the planner reads the pure rules of ``sharding.units``, ``policy`` and ``context``
without importing FSDP2's ``fully_shard`` and everything ``shard()`` needs.
"""

from typing import TYPE_CHECKING

from fsdpkit.lazy import lazy_exports

if TYPE_CHECKING:
    from fsdpkit.sharding.apply import ShardPlan, shard
    from fsdpkit.sharding.blocks import (
        BlockChoice,
        BlockDetectionError,
        choose_blocks,
        detect_blocks,
    )
    from fsdpkit.sharding.grads import clip_grad_norm, gradient_sync
    from fsdpkit.sharding.policy import make_grad_scaler, resolve_precision
    from fsdpkit.sharding.units import UnitSpec, unit_specs

_HOMES = {
    "ShardPlan": "fsdpkit.sharding.apply",
    "shard": "fsdpkit.sharding.apply",
    **dict.fromkeys(
        ["BlockChoice", "BlockDetectionError", "choose_blocks", "detect_blocks"],
        "fsdpkit.sharding.blocks",
    ),
    "clip_grad_norm": "fsdpkit.sharding.grads",
    "gradient_sync": "fsdpkit.sharding.grads",
    "make_grad_scaler": "fsdpkit.sharding.policy",
    "resolve_precision": "fsdpkit.sharding.policy",
    "UnitSpec": "fsdpkit.sharding.units",
    "unit_specs": "fsdpkit.sharding.units",
}
__all__ = [
    "BlockChoice",
    "BlockDetectionError",
    "ShardPlan",
    "UnitSpec",
    "choose_blocks",
    "clip_grad_norm",
    "detect_blocks",
    "gradient_sync",
    "make_grad_scaler",
    "resolve_precision",
    "shard",
    "unit_specs",
]
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
