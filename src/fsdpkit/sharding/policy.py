"""From config sections to FSDP2 policies: precision, offload, resharding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdpkit.config import ParallelConfig, PrecisionConfig


@dataclass(frozen=True)
class Precision:
    """A resolved precision preset."""

    name: str
    """fp32, bf16, bf16-pure or fp16."""
    param_dtype: torch.dtype
    """Dtype of the unsharded parameters used for compute."""
    reduce_dtype: torch.dtype
    """Dtype of the gradient reduce-scatter / all-reduce."""
    scaler: bool
    """Whether a dynamic loss scaler is needed."""

    def policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)


_PRESETS = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.float32),
    "bf16-pure": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float32),
}


def resolve_precision(cfg: PrecisionConfig, *, device_type: str) -> Precision:
    """Pick the preset; ``auto`` is bf16 on a GPU that supports it, else fp32."""
    name = cfg.mode
    if name == "auto":
        bf16_ok = device_type == "cuda" and torch.cuda.is_bf16_supported()
        name = "bf16" if bf16_ok else "fp32"
    param_dtype, reduce_dtype = _PRESETS[name]
    scaler = cfg.grad_scaler if cfg.grad_scaler is not None else name == "fp16"
    return Precision(name=name, param_dtype=param_dtype, reduce_dtype=reduce_dtype, scaler=scaler)


def norm_policy(precision: Precision) -> MixedPrecisionPolicy:
    """Norm layers in fp32 that hand the rest of the block its compute dtype."""
    return MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=precision.param_dtype
    )


def offload_policy(*, enabled: bool, device_type: str) -> OffloadPolicy:
    """CPU offload; pinned memory only where an accelerator exists (it fails without)."""
    if not enabled:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def reshard_after_forward(cfg: ParallelConfig) -> bool | int:
    """The strategy's ``reshard_after_forward``, unless the config overrides it."""
    if cfg.reshard_after_forward is not None:
        return cfg.reshard_after_forward
    return cfg.strategy in ("full", "hybrid")


def unit_reshard_after_forward(raf: bool | int, *, index: int | None, n_units: int) -> bool | int:
    """Resharding of block unit ``index`` (None = the root unit).

    The root (embedding, head) and the last block are needed again at once by
    backward, so with ``raf`` True they stay unsharded (as torchtitan does for the last
    block and FSDP2 by default for a root); other units follow ``raf``.
    """
    if raf is True and (index is None or index == n_units - 1):
        return False
    return raf


def make_grad_scaler(
    precision: Precision, *, device_type: str = "cpu"
) -> torch.amp.GradScaler | None:
    """A scaler that unscales sharded (DTensor) gradients and agrees across ranks on
    inf/NaN, or None when the preset does not need one."""
    if not precision.scaler:
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device_type)
