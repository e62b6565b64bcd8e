"""Turning a plain model into a correctly sharded FSDP2 model.

The names below are imported on first use ([Note: lazy package faces] in fsdpkit.lazy):
the planner reads the pure rules of ``sharding.units``, ``policy`` and ``context``
without importing FSDP2's ``fully_shard`` and everything ``shard()`` needs.
"""

from typing import TYPE_CHECKING

from fsdpkit.lazy import lazy_exports

if TYPE_CHECKING:  # the names of _HOMES from their modules (tests/unit/test_lazy_faces.py)
    from fsdpkit.sharding.apply import ShardPlan as ShardPlan
    from fsdpkit.sharding.apply import shard as shard
    from fsdpkit.sharding.blocks import BlockChoice as BlockChoice
    from fsdpkit.sharding.blocks import BlockDetectionError as BlockDetectionError
    from fsdpkit.sharding.blocks import choose_blocks as choose_blocks
    from fsdpkit.sharding.blocks import detect_blocks as detect_blocks
    from fsdpkit.sharding.grads import clip_grad_norm as clip_grad_norm
    from fsdpkit.sharding.grads import gradient_sync as gradient_sync
    from fsdpkit.sharding.policy import make_grad_scaler as make_grad_scaler
    from fsdpkit.sharding.policy import resolve_precision as resolve_precision
    from fsdpkit.sharding.units import UnitSpec as UnitSpec
    from fsdpkit.sharding.units import unit_specs as unit_specs

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
"""Where each public name lives: the one list of them ([Note: lazy package faces] in
fsdpkit.lazy)."""

__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
