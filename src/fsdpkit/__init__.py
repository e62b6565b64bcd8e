"""fsdpkit: correct, fast FSDP2 training for models that don't fit on one device."""

from fsdpkit.config import ConfigError, RunConfig
from fsdpkit.models.buffers import meta_params
from fsdpkit.models.hf_init import init_weights
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
from fsdpkit.version import __version__

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
