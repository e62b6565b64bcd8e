"""Devices: the one table of accelerators (memory, peak FLOPs, links), the one parser
of device strings, and the one place that decides "CUDA or CPU".

A device is a name from ``DEVICES`` (``h100``, ``a100-40gb``, ``cpu`` ...), a size
(``80GiB``, ``40GB``, ``81920MiB``: a generic GPU of that memory), or ``NAME:SIZE``
to override a known device's memory (``cpu:64GiB``). Memory figures are what
``torch.cuda.mem_get_info`` reports as total on that part, not the marketing number;
peak FLOPs are the dense figures of the data sheet: MFU is reported against them
(``fsdpkit.train.telemetry``); bandwidths are nominal and only used to *rank*
configurations (``--recommend``), never to predict memory.
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
    """Dense bf16/fp16 TFLOP/s (fp32 on CPU): MFU's denominator in low precision."""
    intra_gbps: float = 300.0
    """Collective bus bandwidth inside a node, GB/s per rank."""
    inter_gbps: float = 50.0
    """Collective bandwidth across nodes, GB/s per rank."""
    host_gbps: float = 25.0
    """Host<->device copy bandwidth (CPU offload), GB/s."""
    runtime_reserve: int = 0
    """Bytes the runtime holds outside tensors (CUDA context, NCCL buffers)."""
    tflops_fp32: float | None = None
    """Dense TF32/fp32 matmul TFLOP/s: MFU's denominator for fp32 training."""
    match: tuple[str, ...] = ()
    """Substrings of ``torch.cuda.get_device_name()`` that identify this part."""

    def peak_flops(self, *, low_precision: bool) -> float | None:
        """Dense peak FLOP/s for MFU; None where no honest peak is known (CPUs)."""
        if self.kind != "gpu":
            return None
        tflops = self.tflops if low_precision else self.tflops_fp32
        return tflops * 1e12 if tflops else None


_CUDA_RESERVE = GiB  # CUDA context + NCCL workspaces, measured ~0.6-1 GiB on Hopper


def _gpu(
    name: str,
    gib: float,
    tflops: float,
    fp32: float,
    intra: float,
    inter: float,
    host: float,
    *,
    match: tuple[str, ...],
    bf16: bool = True,
) -> Device:
    return Device(name, "gpu", int(gib * GiB), bf16, tflops, intra, inter, host, _CUDA_RESERVE,
                  tflops_fp32=fp32, match=match)  # fmt: skip


# name, memory GiB, dense bf16 / tf32 TFLOP/s, intra-node / inter-node / host GB/s
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        _gpu("h100", 79.1, 989, 494, 360, 50, 50, match=("h100", "h800")),
        _gpu("h200", 139.8, 989, 494, 360, 50, 50, match=("h200",)),
        _gpu("b200", 178.4, 2250, 1100, 720, 50, 50, match=("b200",)),
        _gpu("a100-40gb", 39.4, 312, 156, 230, 25, 25, match=("a100", "a800")),
        _gpu("a100-80gb", 79.1, 312, 156, 230, 25, 25, match=("a100", "a800")),
        _gpu("l40s", 44.4, 362, 183, 16, 12.5, 25, match=("l40s",)),
        _gpu("l4", 22.0, 121, 60, 16, 12.5, 16, match=("l4",)),
        _gpu("a10g", 22.0, 70, 35, 16, 12.5, 16, match=("a10g",)),
        _gpu("a10", 22.0, 125, 62.5, 16, 12.5, 16, match=("a10",)),
        _gpu("v100-16gb", 15.8, 125, 15.7, 130, 12.5, 12, match=("v100",), bf16=False),
        _gpu("v100-32gb", 31.7, 125, 15.7, 130, 12.5, 12, match=("v100",), bf16=False),
        _gpu("rtx-4090", 23.6, 165, 82.6, 16, 12.5, 25, match=("4090",)),
        _gpu("mi300x", 191.5, 1307, 654, 300, 50, 50, match=("mi300x",)),
        Device("cpu", "cpu", None, False, 1.0, 5, 1, 1000, 0),
    )
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


DEFAULT_MARGIN = 0.10
"""Share of device memory kept free: allocator fragmentation and what no model sees (the
caching allocator typically reserves 5-15% above what tensors use). The planner's
default, kept with the device table so ``fsdpkit plan --help`` shows it cheaply."""


def usable_bytes(device: Device, *, margin: float) -> int | None:
    """Memory tensors may use: device memory minus the runtime reserve and the margin."""
    if device.memory is None:
        return None
    return int((device.memory - device.runtime_reserve) * (1.0 - margin))


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


def device_from(*, name: str | None, memory: str | None) -> Device | None:
    """The device of ``--device NAME`` and/or ``--device-mem SIZE|NAME|NAME:SIZE``
    (None when neither is given); a CPU without a size gets this machine's memory."""
    if name and memory:
        spec = memory if ":" in memory or not memory[:1].isdigit() else f"{name}:{memory}"
        device = parse_device(spec)
    elif name or memory:
        device = parse_device(name or memory or "", what="--device" if name else "--device-mem")
    else:
        return None
    if device.kind == "cpu" and device.memory is None:
        device = replace(device, memory=host_memory_bytes())
    return device


def _from_name(name: str, *, memory: int) -> Device | None:
    """The catalogue part whose ``match`` appears in a CUDA device name, the one
    closest in memory when several do (A100 40GB vs 80GB)."""
    lowered = name.lower()
    hits = [d for d in DEVICES.values() if any(m in lowered for m in d.match)]
    if not hits:
        return None
    longest = max(len(m) for d in hits for m in d.match if m in lowered)
    hits = [d for d in hits if any(m in lowered and len(m) == longest for m in d.match)]
    best = min(hits, key=lambda d: abs((d.memory or 0) - memory))
    return replace(best, memory=memory)


def device_type() -> str:
    """``"cuda"`` when this process sees a GPU, else ``"cpu"``: the one place fsdpkit
    decides which backend (NCCL or gloo), device mesh and memory counters to use."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def local_gpus() -> int:
    """GPUs visible to this process (0 on a CPU-only machine)."""
    import torch

    return torch.cuda.device_count() if device_type() == "cuda" else 0


def detected_device() -> Device | None:
    """The local GPU as a catalogue ``Device`` with its real memory (a generic GPU of
    that memory when the part is unknown), or None without a GPU."""
    if device_type() != "cuda":
        return None
    import torch

    props = torch.cuda.get_device_properties(0)
    known = _from_name(props.name, memory=props.total_memory)
    if known is not None:
        return known
    bf16 = bool(torch.cuda.is_bf16_supported())
    return Device("gpu", "gpu", props.total_memory, bf16, runtime_reserve=_CUDA_RESERVE)


def cpu_device(*, ranks: int) -> Device:
    """A CPU rank's "device": its share of this machine's memory."""
    return replace(DEVICES["cpu"], memory=host_memory_bytes() // max(ranks, 1))
