"""What the environment checks look at, gathered once from this machine.

Checks take an ``EnvFacts`` instead of asking torch or the OS themselves, so every
verdict is unit-testable with made-up facts (a 64 MiB /dev/shm, eight GPUs without
peer access, a CUDA machine with a CPU-only torch) on any machine. ``gather`` is the
only function here that touches the system; it runs the same on CPU and CUDA (and
ROCm, which torch exposes through ``torch.cuda``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import resource
import shutil
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpkit.version import __version__

RELEVANT_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "GLOO_", "PYTORCH_CUDA_ALLOC")
RELEVANT_NAMES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "PYTORCH_ALLOC_CONF",
    "TORCH_CPP_LOG_LEVEL",
)


@dataclass(frozen=True)
class GpuInfo:
    """One visible GPU."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int | None
    """Free memory as the driver reports it (others' processes count); None if unknown."""
    capability: tuple[int, int]
    bf16: bool


@dataclass(frozen=True)
class EnvFacts:
    """Everything the environment checks need, as plain data."""

    torch_version: str
    fsdpkit_version: str
    python_version: str
    cuda_version: str | None = None
    """torch.version.cuda: None for a CPU or ROCm build."""
    hip_version: str | None = None
    distributed: bool = True
    fsdp2_error: str | None = None
    """Why ``from torch.distributed.fsdp import fully_shard`` failed (None: it works)."""
    dcp_error: str | None = None
    gloo: bool = True
    nccl: bool = False
    nccl_version: str | None = None
    gpus: tuple[GpuInfo, ...] = ()
    p2p_missing: tuple[tuple[int, int], ...] = ()
    """GPU pairs (i, j) where i cannot access j's memory directly."""
    os_gpu_devices: int = 0
    """GPU device nodes the OS shows (/dev/nvidiaN, /dev/dri/renderD* with /dev/kfd)."""
    cpu_count: int = 1
    cpu_bf16_slowdown: float | None = None
    """Time of a bf16 matmul over an fp32 one on this CPU (measured when there is no GPU;
    CPUs without native bf16 kernels run it many times slower)."""
    environ: Mapping[str, str] = field(default_factory=dict)
    """The relevant environment variables (see RELEVANT_*), as set."""
    interfaces: tuple[str, ...] = ()
    shm_bytes: int | None = None
    """Size of /dev/shm (None: missing)."""
    nofile: tuple[int, int] | None = None
    """Open-file limit (soft, hard)."""
    disk_path: str = "."
    disk_free: int | None = None
    local_ranks: int = 1
    """Ranks this machine will run (for thread oversubscription)."""
    cxx_name: str = "g++"
    """The C++ compiler inductor calls for CPU kernels (train.compile): $CXX, else g++
    (clang++ on macOS), as torch._inductor.config.cpp.cxx picks it."""
    cxx: str | None = None
    """Its path on PATH (None: not found)."""
    triton: bool = False
    """Triton (inductor's GPU code generator) is importable."""


def relevant_environ(environ: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in sorted(environ.items())
        if k in RELEVANT_NAMES or k.startswith(RELEVANT_PREFIXES)
    }


def _missing(module: str, *names: str) -> str | None:
    """None when ``module`` imports and has ``names``, else why not."""
    try:
        imported = importlib.import_module(module)
        for name in names:
            getattr(imported, name)
    except Exception as exc:
        return f"{module}: {type(exc).__name__}: {exc}"
    return None


def _gpus() -> tuple[tuple[GpuInfo, ...], tuple[tuple[int, int], ...]]:
    import torch

    if not torch.cuda.is_available():
        return (), ()
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        try:
            free: int | None = torch.cuda.mem_get_info(i)[0]
        except RuntimeError:
            free = None
        cap = (props.major, props.minor)
        bf16 = cap >= (8, 0) if torch.version.hip is None else torch.cuda.is_bf16_supported()
        gpus.append(GpuInfo(i, props.name, props.total_memory, free, cap, bf16))
    n = len(gpus)
    missing = tuple(
        (i, j)
        for i in range(n)
        for j in range(n)
        if i != j and not torch.cuda.can_device_access_peer(i, j)
    )
    return tuple(gpus), missing


def _os_gpu_devices() -> int:
    dev = Path("/dev")
    nvidia = [p for p in dev.glob("nvidia[0-9]*")]
    amd = list(dev.glob("dri/renderD*")) if (dev / "kfd").exists() else []
    return len(nvidia) + len(amd)


def _cpu_bf16_slowdown() -> float:
    """bf16 / fp32 time of a 512x512 matmul on one thread (best of 3 each, ~20 ms)."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = {}
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(512, 512).to(dtype)
            a @ a  # warm-up
            times = []
            for _ in range(3):
                start = time.perf_counter()
                a @ a
                times.append(time.perf_counter() - start)
            best[dtype] = min(times)
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def _nccl_version() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _disk(run_dir: Path) -> tuple[str, int | None]:
    """Free bytes on the file system that will hold ``run_dir`` (its nearest existing
    ancestor when it does not exist yet)."""
    path = run_dir.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return str(path), None
    return str(path), st.f_bavail * st.f_frsize


def _shm() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def _interfaces() -> tuple[str, ...]:
    try:
        return tuple(name for _, name in socket.if_nameindex())
    except OSError:
        return ()


def fsdpkit_version() -> str:
    """The running fsdpkit's version (fsdpkit.version: what a source checkout runs too,
    where installed metadata may be missing or stale)."""
    return __version__


def gather(*, environ: Mapping[str, str], run_dir: Path, local_ranks: int) -> EnvFacts:
    """Facts of this machine. ``environ`` is passed in (the CLI reads the environment)."""
    import torch
    import torch.distributed as dist

    gpus, p2p_missing = _gpus()
    disk_path, disk_free = _disk(run_dir)
    distributed = dist.is_available()
    return EnvFacts(
        torch_version=torch.__version__,
        fsdpkit_version=fsdpkit_version(),
        python_version=platform.python_version(),
        cuda_version=torch.version.cuda,
        hip_version=torch.version.hip,
        distributed=distributed,
        fsdp2_error=_missing(
            "torch.distributed.fsdp", "fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy"
        ),
        dcp_error=_missing(
            "torch.distributed.checkpoint", "save", "load", "async_save", "HuggingFaceStorageReader"
        )
        or _missing("torch.distributed.checkpoint.state_dict", "get_state_dict", "set_state_dict"),
        gloo=distributed and dist.is_gloo_available(),
        nccl=distributed and dist.is_nccl_available(),
        nccl_version=_nccl_version(),
        gpus=gpus,
        p2p_missing=p2p_missing,
        os_gpu_devices=_os_gpu_devices(),
        cpu_count=os.cpu_count() or 1,
        cpu_bf16_slowdown=None if gpus else _cpu_bf16_slowdown(),
        environ=relevant_environ(environ),
        interfaces=_interfaces(),
        shm_bytes=_shm(),
        nofile=resource.getrlimit(resource.RLIMIT_NOFILE),
        disk_path=disk_path,
        disk_free=disk_free,
        local_ranks=local_ranks,
        **compile_toolchain(environ),
    )


def compile_toolchain(environ: Mapping[str, str]) -> dict[str, Any]:
    """``cxx_name``, ``cxx`` and ``triton`` of ``EnvFacts``: what inductor needs
    (train.compile), read cheaply (``fsdpkit train`` checks it before launching)."""
    name = environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    triton = importlib.util.find_spec("triton") is not None
    return {"cxx_name": name, "cxx": shutil.which(name), "triton": triton}
