"""The mixed-precision presets: one frozen record each, the only place their dtypes live.

``shard()`` turns a preset into FSDP2's ``MixedPrecisionPolicy``; the planner reads its
bytes per element; config validation and ``precision.mode = auto`` read the same table.

    fp32       fp32 compute and reduction
    bf16       bf16 compute, fp32 gradient reduction (the usual choice on GPUs)
    bf16-pure  bf16 compute and reduction (half the reduce-scatter traffic, less exact)
    fp16       fp16 compute, fp32 reduction, dynamic loss scaling
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fsdpkit.precision_modes import MODES

if TYPE_CHECKING:  # torch.distributed.fsdp costs ~0.7 s to import (DTensor, sympy)
    from torch.distributed.fsdp import MixedPrecisionPolicy


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
    """Whether a dynamic loss scaler is used (the preset's default unless the config
    says otherwise)."""

    @property
    def param_bytes(self) -> int:
        return self.param_dtype.itemsize

    @property
    def reduce_bytes(self) -> int:
        return self.reduce_dtype.itemsize

    @property
    def low_precision(self) -> bool:
        return self.param_dtype != torch.float32

    def policy(self) -> MixedPrecisionPolicy:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def norm_policy(self) -> MixedPrecisionPolicy:
        """Norm layers in fp32 that hand the rest of the block its compute dtype."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=self.param_dtype
        )


PRESETS: dict[str, Precision] = {
    m.name: Precision(m.name, getattr(torch, m.param), getattr(torch, m.reduce), scaler=m.scaler)
    for m in MODES.values()
}
"""fsdpkit.precision_modes' table with torch dtypes."""
AUTO = "auto"
"""``precision.mode = auto``: bf16 where the device computes in bf16, else fp32."""


def preset_name(mode: str, *, bf16_device: bool) -> str:
    """The preset ``mode`` stands for on a device that does (not) support bf16."""
    if mode != AUTO:
        return mode
    return "bf16" if bf16_device else "fp32"


def preset_for(mode: str, *, bf16_device: bool, grad_scaler: bool | None = None) -> Precision:
    """The preset for ``mode`` (``auto`` resolved), with the config's scaler choice."""
    preset = PRESETS[preset_name(mode, bf16_device=bf16_device)]
    if grad_scaler is None or grad_scaler == preset.scaler:
        return preset
    return Precision(preset.name, preset.param_dtype, preset.reduce_dtype, scaler=grad_scaler)
