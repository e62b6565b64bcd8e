"""``shard``: apply FSDP2 to a model the way it should be done.

Order (as torchtitan): meta-device model -> activation checkpointing -> optional fp32
norm units -> ``fully_shard`` per block (or group of k blocks), bottom-up -> root ->
materialize local shards (meta models only). The optimizer must be built after this.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from fsdpkit.config import RunConfig
from fsdpkit.sharding.activations import apply_activation_checkpointing
from fsdpkit.sharding.blocks import detect_blocks
from fsdpkit.sharding.materialize import is_meta, materialize
from fsdpkit.sharding.policy import (
    norm_policy,
    offload_policy,
    reshard_after_forward,
    resolve_precision,
    unit_reshard_after_forward,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardPlan:
    """What ``shard`` did, for logs and tests."""

    block_class: str | None
    """Class name of the blocks (None when the model has no repeated blocks)."""
    units: int
    """FSDP units below the root."""
    params_per_unit: int
    """Parameters in the first unit."""
    root_params: int
    """Parameters left to the root unit (embeddings, tied head, final norm...)."""
    checkpointed: int
    """Blocks whose activations are recomputed in backward."""
    precision: str
    """Resolved precision preset."""
    reshard_after_forward: bool | int
    """The strategy's resharding of block units."""

    def describe(self) -> str:
        if not self.units:
            return f"1 unit (root only, {_m(self.root_params)} params); precision {self.precision}"
        return (
            f"{self.units} x {self.block_class} units ({_m(self.params_per_unit)} params each), "
            f"root holds {_m(self.root_params)}; activation checkpointing on "
            f"{self.checkpointed}/{self.units}; precision {self.precision}; "
            f"reshard_after_forward={self.reshard_after_forward}"
        )


def _m(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def _is_norm(module: nn.Module) -> bool:
    is_norm_class = isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("Norm")
    return is_norm_class and any(True for _ in module.parameters(recurse=False))


def _units(blocks: list[nn.Module], k: int) -> list[list[nn.Module]]:
    return [blocks[i : i + k] for i in range(0, len(blocks), k)]


def shard(model: nn.Module, cfg: RunConfig, *, mesh: DeviceMesh) -> ShardPlan:
    """Shard ``model`` in place with FSDP2 following ``cfg``'s parallel, precision,
    offload and activations sections; returns the plan it applied.

    A model built under ``torch.device("meta")`` is materialized afterwards with only
    the local shards allocated, initialized from ``cfg.train.seed`` exactly as
    ``fsdpkit.init.init_weights`` would initialize the unsharded model.
    """
    device_type = mesh.device_type
    precision = resolve_precision(cfg.precision, device_type=device_type)
    blocks = detect_blocks(model, class_names=cfg.parallel.block_classes or None)
    block_class = type(blocks[0]).__name__ if blocks else None  # before FSDP renames it
    checkpointed = apply_activation_checkpointing(blocks, cfg.activations)
    raf = reshard_after_forward(cfg.parallel)
    offload = offload_policy(enabled=cfg.offload.params, device_type=device_type)
    if cfg.precision.norms_fp32 and precision.param_dtype != torch.float32:
        for norm in [m for m in model.modules() if _is_norm(m)]:
            fully_shard(
                norm,
                mesh=mesh,
                reshard_after_forward=raf,
                mp_policy=norm_policy(precision),
                offload_policy=offload,
            )
    units = _units(blocks, cfg.parallel.blocks_per_unit)
    for i, unit in enumerate(units):
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=unit_reshard_after_forward(raf, index=i, n_units=len(units)),
            mp_policy=precision.policy(),
            offload_policy=offload,
        )
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=unit_reshard_after_forward(raf, index=None, n_units=len(units)),
        mp_policy=precision.policy(),
        offload_policy=offload,
    )
    if is_meta(model):
        _materialize(model, cfg, device_type=device_type)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    plan = ShardPlan(
        block_class=block_class,
        units=len(units),
        params_per_unit=sum(p.numel() for b in units[0] for p in b.parameters()) if units else 0,
        root_params=sum(p.numel() for p in model.parameters() if id(p) not in in_blocks),
        checkpointed=checkpointed,
        precision=precision.name,
        reshard_after_forward=raf,
    )
    log.info("fsdpkit.shard: %s", plan.describe())
    return plan


def _materialize(model: nn.Module, cfg: RunConfig, *, device_type: str) -> None:
    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    param_device = torch.device("cpu") if cfg.offload.params else device
    materialize(model, seed=cfg.train.seed, param_device=param_device, buffer_device=device)
