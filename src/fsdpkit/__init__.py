"""fsdpkit: correct, fast FSDP2 training for models that don't fit on one device.

The public API is imported on first use ([Note: lazy package faces] in fsdpkit.lazy),
so ``import fsdpkit.cli`` and commands such as ``fsdpkit --help`` do not pay for torch
and FSDP2; ``from fsdpkit import shard`` works as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpkit.lazy import lazy_exports
from fsdpkit.version import __version__ as __version__

if TYPE_CHECKING:  # the names of _HOMES from their modules (tests/unit/test_lazy_faces.py)
    from fsdpkit.config import ConfigError as ConfigError
    from fsdpkit.config import RunConfig as RunConfig
    from fsdpkit.models.buffers import meta_params as meta_params
    from fsdpkit.models.hf.initialize import init_weights as init_weights
    from fsdpkit.sharding.apply import ShardPlan as ShardPlan
    from fsdpkit.sharding.apply import shard as shard
    from fsdpkit.sharding.blocks import BlockDetectionError as BlockDetectionError
    from fsdpkit.sharding.blocks import detect_blocks as detect_blocks
    from fsdpkit.sharding.grads import clip_grad_norm as clip_grad_norm
    from fsdpkit.sharding.grads import gradient_sync as gradient_sync
    from fsdpkit.sharding.mesh import MeshError as MeshError
    from fsdpkit.sharding.mesh import build_mesh as build_mesh
    from fsdpkit.sharding.policy import make_grad_scaler as make_grad_scaler
    from fsdpkit.sharding.policy import resolve_precision as resolve_precision

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
"""Where each public name lives: the one list of them ([Note: lazy package faces] in
fsdpkit.lazy)."""

__all__ = sorted([*_HOMES, "__version__"])
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
