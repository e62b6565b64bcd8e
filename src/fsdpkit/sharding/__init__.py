"""Turning a plain model into a correctly sharded FSDP2 model."""

from fsdpkit.sharding.apply import ShardPlan, shard
from fsdpkit.sharding.blocks import BlockChoice, BlockDetectionError, choose_blocks, detect_blocks
from fsdpkit.sharding.grads import clip_grad_norm, gradient_sync
from fsdpkit.sharding.policy import make_grad_scaler, resolve_precision
from fsdpkit.sharding.units import UnitSpec, unit_specs

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
