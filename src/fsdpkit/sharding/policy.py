"""From config sections to FSDP2 policies: precision, offload, resharding, gradient
accumulation ([Note: accumulation modes] in fsdpkit.sharding.grads).

The presets and strategies themselves live in ``fsdpkit.precision`` and
``fsdpkit.strategies``; this module applies them to a config and a device. The planner
calls the same functions, so a plan and a run cannot disagree on what they decide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:  # FSDP2 is imported by shard(), not by the planner's rules below
    from torch.distributed.fsdp import OffloadPolicy

from fsdpkit import precision as presets
from fsdpkit.config import ParallelConfig, PrecisionConfig
from fsdpkit.precision import Precision
from fsdpkit.strategies import strategy


def bf16_device(device_type: str) -> bool:
    """Whether ``precision.mode = auto`` means bf16 on this process's device."""
    return device_type == "cuda" and torch.cuda.is_bf16_supported()


def resolve_precision(cfg: PrecisionConfig, *, device_type: str) -> Precision:
    """The preset a run uses; ``auto`` is bf16 on a GPU that supports it, else fp32."""
    return presets.preset_for(
        cfg.mode, bf16_device=bf16_device(device_type), grad_scaler=cfg.grad_scaler
    )


def offload_policy(*, enabled: bool, device_type: str) -> OffloadPolicy:
    """CPU offload; pinned memory only where an accelerator exists (it fails without)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not enabled:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def reshard_after_forward(cfg: ParallelConfig) -> bool | int:
    """The strategy's ``reshard_after_forward``, unless the config overrides it."""
    if cfg.reshard_after_forward is not None:
        return cfg.reshard_after_forward
    return strategy(cfg.strategy).reshards_after_forward


def unit_reshard_after_forward(raf: bool | int, *, index: int | None, n_units: int) -> bool | int:
    """Resharding of block unit ``index`` (None = the root unit): see [Note: unit
    resharding] in fsdpkit.sharding.units."""
    if raf is True and (index is None or index == n_units - 1):
        return False
    return raf


def effective_reshard(raf: bool | int, *, shard: int) -> bool | int:
    """What FSDP2 makes of ``reshard_after_forward``: an int equal to the shard group
    is True, 1 is False."""
    if isinstance(raf, bool):
        return raf
    return True if raf == shard else False if raf == 1 else raf


def make_grad_scaler(
    precision: Precision, *, device_type: str = "cpu"
) -> torch.amp.GradScaler | None:
    """A scaler that unscales sharded (DTensor) gradients and agrees across ranks on
    inf/NaN, or None when the preset does not need one."""
    if not precision.scaler:
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device_type)


SyncMode = Literal["last", "every"]
"""A resolved ``parallel.accum_sync`` (``auto`` is decided before the run starts)."""


def sync_mode(accum_sync: str) -> SyncMode:
    """The runtime's mode for a config value: ``auto`` left unresolved (no memory
    budget was given, fsdpkit.planner.search.auto) means ``last``."""
    return "every" if accum_sync == "every" else "last"
