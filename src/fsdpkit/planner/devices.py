"""Known accelerators and memory sizes: what ``--device-mem`` accepts.

A device is a name from ``DEVICES`` (``h100``, ``a100-40gb``, ``cpu`` ...), a size
(``80GiB``, ``40GB``, ``81920MiB``: a generic GPU of that memory), or ``NAME:SIZE``
to override a known device's memory (``cpu:64GiB``). Memory figures are what
``torch.cuda.mem_get_info`` reports as total on that part, not the marketing number;
throughput and bandwidth figures are nominal and only used to *rank* configurations
(``--recommend``), never to predict memory.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, replace

from fsdpkit.errors import UserError

GiB = 1024**3


class DeviceError(UserError, ValueError):
    """The device name or memory size is not understood."""


@dataclass(frozen=True)
class Device:
    """One rank's device, as far as the planner cares."""

    name: str
    """Catalogue name, or "gpu" for a bare memory size."""
    kind: str
    """"gpu" (CUDA-like: bf16 autocast, NCCL) or "cpu" (gloo; host and device are one)."""
    memory: int | None
    """Bytes of device memory; None when unknown (no fit verdict then)."""
    bf16: bool = True
    """Whether precision.mode = auto resolves to bf16 on it."""
    tflops: float = 400.0
    """Dense bf16 (fp32 on CPU) TFLOP/s, for ranking only."""
    intra_gbps: float = 300.0
    """Collective bus bandwidth inside a node, GB/s per rank."""
    inter_gbps: float = 50.0
    """Collective bandwidth across nodes, GB/s per rank."""
    host_gbps: float = 25.0
    """Host<->device copy bandwidth (CPU offload), GB/s."""
    runtime_reserve: int = 0
    """Bytes the runtime holds outside tensors (CUDA context, NCCL buffers)."""


_CUDA_RESERVE = GiB  # CUDA context + NCCL workspaces, measured ~0.6-1 GiB on Hopper

DEVICES: dict[str, Device] = {
    "h100": Device("h100", "gpu", int(79.1 * GiB), True, 989, 360, 50, 50, _CUDA_RESERVE),
    "h200": Device("h200", "gpu", int(139.8 * GiB), True, 989, 360, 50, 50, _CUDA_RESERVE),
    "b200": Device("b200", "gpu", int(178.4 * GiB), True, 2250, 720, 50, 50, _CUDA_RESERVE),
    "a100-40gb": Device("a100-40gb", "gpu", int(39.4 * GiB), True, 312, 230, 25, 25, _CUDA_RESERVE),
    "a100-80gb": Device("a100-80gb", "gpu", int(79.1 * GiB), True, 312, 230, 25, 25, _CUDA_RESERVE),
    "l4": Device("l4", "gpu", int(22.0 * GiB), True, 121, 16, 12.5, 16, _CUDA_RESERVE),
    "a10g": Device("a10g", "gpu", int(22.0 * GiB), True, 70, 16, 12.5, 16, _CUDA_RESERVE),
    "v100-16gb": Device(
        "v100-16gb", "gpu", int(15.8 * GiB), False, 125, 130, 12.5, 12, _CUDA_RESERVE
    ),
    "v100-32gb": Device(
        "v100-32gb", "gpu", int(31.7 * GiB), False, 125, 130, 12.5, 12, _CUDA_RESERVE
    ),
    "rtx-4090": Device("rtx-4090", "gpu", int(23.6 * GiB), True, 165, 16, 12.5, 25, _CUDA_RESERVE),
    "mi300x": Device("mi300x", "gpu", int(191.5 * GiB), True, 1307, 300, 50, 50, _CUDA_RESERVE),
    "cpu": Device("cpu", "cpu", None, False, 1.0, 5, 1, 1000, 0),
}
ALIASES = {
    "h100-80gb": "h100",
    "h100-sxm": "h100",
    "h200-141gb": "h200",
    "a100-80g": "a100-80gb",
    "a100-40g": "a100-40gb",
    "4090": "rtx-4090",
}

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": GiB, "tib": 1024**4,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, *, what: str = "--device-mem") -> int:
    """``"80GiB"`` -> bytes. GB/MB are decimal, GiB/MiB binary, a bare number is bytes."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise DeviceError(
            f"{what} = {text!r} is not a memory size or a known device. Write a size such "
            f"as 80GiB, 40GB or 81920MiB, or one of: {', '.join(DEVICES)}."
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise DeviceError(f"{what} = {text!r} must be a positive size.")
    return value


def _lookup(name: str, *, what: str) -> Device:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key in DEVICES:
        return DEVICES[key]
    names = [*DEVICES, *ALIASES]
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise DeviceError(
        f"{what} = {name!r} is not a known device.{hint} Known: {', '.join(DEVICES)}; "
        "or give the memory itself, e.g. --device-mem 80GiB."
    )


def host_memory_bytes() -> int:
    """This machine's physical memory (a CPU rank's "device" memory is a share of it)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_device(text: str, *, what: str = "--device-mem") -> Device:
    """A device from a name, a size, or ``NAME:SIZE``."""
    if ":" in text:
        name, size = text.split(":", 1)
        return replace(_lookup(name, what=what), memory=parse_size(size, what=what))
    if text.strip() and (text.strip()[0].isdigit() or text.strip()[0] == "."):
        return Device("gpu", "gpu", parse_size(text, what=what), runtime_reserve=_CUDA_RESERVE)
    return _lookup(text, what=what)
