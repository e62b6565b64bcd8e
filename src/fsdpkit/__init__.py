"""fsdpkit: correct, fast FSDP2 training for models that don't fit on one device.

The public API is imported on first use ([Note: lazy package faces] in fsdpkit.lazy),
so ``import fsdpkit.cli`` and commands such as ``fsdpkit --help`` do not pay for torch
and FSDP2; ``from fsdpkit import shard`` works as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpkit.lazy import lazy_exports
from fsdpkit.version import __version__

if TYPE_CHECKING:
    from fsdpkit.config import ConfigError, RunConfig
    from fsdpkit.models.buffers import meta_params
    from fsdpkit.models.hf.initialize import init_weights
    from fsdpkit.sharding import (
        BlockDetectionError,
        ShardPlan,
        clip_grad_norm,
        detect_blocks,
        gradient_sync,
        make_grad_scaler,
        resolve_precision,
        shard,
    )
    from fsdpkit.sharding.mesh import MeshError, build_mesh

_HOMES = {
    "ConfigError": "fsdpkit.config",
    "RunConfig": "fsdpkit.config",
    "meta_params": "fsdpkit.models.buffers",
    "init_weights": "fsdpkit.models.hf.initialize",
    "MeshError": "fsdpkit.sharding.mesh",
    "build_mesh": "fsdpkit.sharding.mesh",
    "BlockDetectionError": "fsdpkit.sharding.blocks",
    "detect_blocks": "fsdpkit.sharding.blocks",
    "ShardPlan": "fsdpkit.sharding.apply",
    "shard": "fsdpkit.sharding.apply",
    "clip_grad_norm": "fsdpkit.sharding.grads",
    "gradient_sync": "fsdpkit.sharding.grads",
    "make_grad_scaler": "fsdpkit.sharding.policy",
    "resolve_precision": "fsdpkit.sharding.policy",
}
"""Where each public name lives ([Note: lazy package faces] in fsdpkit.lazy)."""

__all__ = [
    "BlockDetectionError",
    "ConfigError",
    "MeshError",
    "RunConfig",
    "ShardPlan",
    "__version__",
    "build_mesh",
    "clip_grad_norm",
    "detect_blocks",
    "gradient_sync",
    "init_weights",
    "make_grad_scaler",
    "meta_params",
    "resolve_precision",
    "shard",
]
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
