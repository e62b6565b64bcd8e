"""Per-step measurements: throughput, MFU, peak memory, and metrics.jsonl.

[Note: peak memory]
CUDA: ``torch.cuda.max_memory_allocated`` (the caching allocator's peak of live
tensors). CPU: the process's resident-set high-water mark (``getrusage`` ru_maxrss).
RSS includes the Python interpreter, torch's libraries and allocator slack, so it
overstates tensor memory (1.4-2.1x measured on these machines); it is reported as
what it is (``peak_mem_kind``) rather than dressed up as tensor memory.

[Note: MFU]
MFU = achieved model FLOP/s per device / the device's dense peak. Model FLOPs per
token are the standard 6N + 12*L*H*Q*T (nanoGPT / PaLM). On a CPU no honest peak is
known, so MFU is null there and tokens/s is the figure to watch.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import torch

# Dense peak TFLOP/s per device: (bf16/fp16 tensor cores, tf32/fp32 matmul).
_PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "h200": (989.0, 494.0),
    "h100": (989.0, 494.0),
    "h800": (989.0, 494.0),
    "a100": (312.0, 156.0),
    "a800": (312.0, 156.0),
    "l40s": (362.0, 183.0),
    "l4": (121.0, 60.0),
    "a10": (125.0, 62.5),
    "v100": (125.0, 15.7),
    "mi300x": (1307.0, 654.0),
}


def device_peak_flops(*, device_type: str, low_precision: bool) -> float | None:
    """Peak FLOP/s of this process's device, or None when unknown (CPU included)."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower()
    for key, (half, single) in _PEAK_TFLOPS.items():
        if key in name:
            return (half if low_precision else single) * 1e12
    return None


def peak_memory_mib(device_type: str) -> float:
    """This rank's peak memory so far (see [Note: peak memory])."""
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory_kind(device_type: str) -> str:
    return "cuda_max_allocated" if device_type == "cuda" else "cpu_max_rss"


def _step_of(line: str) -> int | None:
    """The step of a metrics line; None for a torn line (a killed writer leaves one)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return None


class MetricsWriter:
    """Appends one JSON object per logged step to ``metrics.jsonl`` (rank 0 only)."""

    def __init__(self, path: Path, *, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled

    def start(self, *, resumed_step: int) -> None:
        """Drop records past the resumed step (a fresh run keeps none), so a restarted
        or re-run job leaves one consistent history."""
        if not self.enabled or not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if _step_of(line) is not None and _step_of(line) <= resumed_step  # type: ignore[operator]
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
