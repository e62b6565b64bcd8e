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

from fsdpkit.devices import detected_device
from fsdpkit.runtime.rundir import append_line, read_jsonl, write_text_atomically
from fsdpkit.version import written_by


def device_peak_flops(*, device_type: str, low_precision: bool) -> float | None:
    """Peak FLOP/s of this process's device from the device table (fsdpkit.devices),
    or None when unknown (CPU included)."""
    if device_type != "cuda":
        return None
    device = detected_device()
    return device.peak_flops(low_precision=low_precision) if device is not None else None


def peak_memory_mib(device_type: str) -> float:
    """This rank's peak memory so far (see [Note: peak memory])."""
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory_kind(device_type: str) -> str:
    return "cuda_max_allocated" if device_type == "cuda" else "cpu_max_rss"


class MetricsWriter:
    """Appends one JSON object per logged step to ``metrics.jsonl`` (rank 0 only),
    whole lines only ([Note: run-dir faults] in fsdpkit.runtime.rundir)."""

    def __init__(self, path: Path, *, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled
        self._stamped = False

    def start(self, *, resumed_step: int) -> None:
        """Drop records past the resumed step (a fresh run keeps none), and a torn
        last line, so a restarted or re-run job leaves one consistent history. The
        file is replaced atomically: a fault here never loses the kept records."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [r for r in read_jsonl(self.path) if int(r.get("step", 0)) <= resumed_step]
        text = "".join(json.dumps(r) + "\n" for r in kept)
        write_text_atomically(self.path, text, what="the metrics file")

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record``; the first one this process writes (a fresh run's first,
        or the first after a resume) also names the fsdpkit and torch versions, so a
        history continued by another release says where it changed."""
        if not self.enabled:
            return
        if not self._stamped:
            record = {**record, **written_by()}
        append_line(self.path, record, what="the metrics file")
        self._stamped = True
