"""The mixed-precision modes as plain facts (dtype names, whether a loss scaler is on
by default), without torch: config validation reads them, so a config error is
answered before torch is imported (~1.5 s). ``fsdpkit.precision`` turns each into its
preset with torch dtypes; this table is the one place the modes are written."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    """One precision mode: the dtypes by torch's names."""

    name: str
    param: str
    """Dtype of the unsharded parameters used for compute (``torch.<param>``)."""
    reduce: str
    """Dtype of the gradient reduction (``torch.<reduce>``)."""
    scaler: bool
    """Whether a dynamic loss scaler is on by default."""

    @property
    def low_precision(self) -> bool:
        return self.param != "float32"


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("fp32", "float32", "float32", scaler=False),
        Mode("bf16", "bfloat16", "float32", scaler=False),
        Mode("bf16-pure", "bfloat16", "bfloat16", scaler=False),
        Mode("fp16", "float16", "float32", scaler=True),
    )
}
