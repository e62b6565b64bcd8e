"""Does this machine have room for the workers asked for? Checked before any starts.

[Note: oversubscription]
``--nproc`` above the CPU cores (CPU runs) or the GPUs (GPU runs) still works but
runs slower than fewer workers would (they time-share a core, or share a GPU): one
warning with the numbers and the suggested value. More workers than host memory
holds is refused: each worker needs ``PROCESS_BYTES`` for Python, torch and its
libraries (measured: 190 MiB of private memory after the imports, ~240 MiB per
worker with 64 tiny-model workers) plus the planner's per-rank host memory for this
config (fsdpkit.planner: the whole peak on a CPU, the offloaded states on a GPU),
compared with what the kernel says is available (``MemAvailable``, and the memory
cgroup's limit when one is set).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fsdpkit.config import RunConfig
from fsdpkit.devices import cpu_device
from fsdpkit.errors import UserError
from fsdpkit.planner import plan

MIB = 2**20
PROCESS_BYTES = {"cpu": 250 * MIB, "cuda": 1536 * MIB}
"""Host memory one worker process needs before its tensors (see the module note;
CUDA adds its context and libraries)."""


class CapacityError(UserError):
    """More workers than this machine can hold."""


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _stat(path: str, key: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def _cgroup_room() -> int | None:
    """The memory cgroup's limit minus its anonymous memory (page cache is reclaimable)."""
    for limit_path, stat_path, anon_key in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.stat", "anon"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.stat",
            "total_rss",
        ),
    ):
        try:
            limit = Path(limit_path).read_text().strip()
        except OSError:
            continue
        used = _stat(stat_path, anon_key)
        if limit.isdigit() and int(limit) < 2**60 and used is not None:
            return int(limit) - used
    return None


def available_memory() -> int | None:
    """Bytes the kernel can give new processes now: MemAvailable, capped by the memory
    cgroup's remaining limit; None when unknown."""
    room = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                room = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cgroup = _cgroup_room()
    if cgroup is not None:
        room = cgroup if room is None else min(room, cgroup)
    return room


def tensor_host_bytes(cfg: RunConfig, *, world_size: int, ranks_per_node: int, device: str) -> int:
    """The planner's host memory per rank for ``cfg`` (0 when the analytic planner cannot
    plan the model, e.g. a user factory)."""

    try:  # formulas only: tracing a model at every launch would cost seconds to minutes
        target = cpu_device(ranks=ranks_per_node) if device == "cpu" else None
        p = plan(
            cfg, world_size=world_size, device=target, ranks_per_node=ranks_per_node, trace=False
        )
    except UserError:
        return 0
    host = p.memory.staging_bytes + p.data_host_bytes
    if device == "cpu":
        return p.memory.peak.bytes + p.memory.spread + host
    return p.memory.host_bytes + host


@dataclass(frozen=True)
class Capacity:
    """What the machine offers and what the run asks."""

    nproc: int
    slots: int
    """CPU cores (CPU runs) or GPUs (GPU runs)."""
    device: str
    per_worker: int
    """Host bytes per worker (process + tensors)."""
    available: int | None

    def warning(self) -> str | None:
        """One line when there are more workers than cores/GPUs."""
        if self.nproc <= self.slots:
            return None
        what = "CPU cores" if self.device == "cpu" else "GPUs"
        share = "time-share the cores" if self.device == "cpu" else "share GPUs"
        return (
            f"warning: --nproc {self.nproc} starts {self.nproc} workers on {self.slots} "
            f"{what}; they {share} and the run is slower than with fewer workers "
            f"(suggested: --nproc {self.slots})."
        )

    def check_memory(self) -> None:
        """CapacityError when the workers do not fit in available memory."""
        if self.available is None or self.nproc * self.per_worker <= self.available:
            return
        fits = max(self.available // self.per_worker, 0)
        gib = 2**30
        raise CapacityError(
            f"--nproc {self.nproc} needs about {self.nproc * self.per_worker / gib:.1f} GiB of "
            f"host memory ({self.nproc} workers x {self.per_worker / MIB:,.0f} MiB: "
            f"{PROCESS_BYTES[self.device] / MIB:,.0f} MiB per process plus the planner's "
            f"per-rank estimate for this config), but only {self.available / gib:.1f} GiB is "
            f"available (MemAvailable / the memory cgroup). Use --nproc {max(fits, 1)} or fewer "
            f"(suggested: --nproc {min(self.slots, max(fits, 1))}), or a machine with more memory."
        )


def capacity(cfg: RunConfig, *, nproc: int, nnodes: int, device: str, gpus: int) -> Capacity:
    """Measure the machine against ``nproc`` workers of ``cfg`` ([Note: oversubscription])."""
    slots = cpu_cores() if device == "cpu" else gpus
    tensors = tensor_host_bytes(cfg, world_size=nproc * nnodes, ranks_per_node=nproc, device=device)
    return Capacity(
        nproc=nproc,
        slots=max(slots, 1),
        device=device,
        per_worker=PROCESS_BYTES.get(device, PROCESS_BYTES["cuda"]) + tensors,
        available=available_memory(),
    )
