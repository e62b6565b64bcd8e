"""Environment checks: torch build, FSDP2/DCP, backends, GPUs, shared memory, limits,
disk. Each is a small pure function of ``EnvFacts`` (see ``fsdpkit.doctor.facts``)."""

from __future__ import annotations

import re

from fsdpkit.doctor.check import Check, fail, ok, skip, warn
from fsdpkit.doctor.envvars import check_environ
from fsdpkit.doctor.facts import EnvFacts

MIN_TORCH = (2, 13)
"""The oldest torch fsdpkit supports (pyproject.toml: torch>=2.13)."""
GiB, MiB = 1024**3, 1024**2


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def _version_tuple(version: str) -> tuple[int, int]:
    numbers = re.findall(r"\d+", version)
    return (int(numbers[0]), int(numbers[1])) if len(numbers) >= 2 else (0, 0)


def _build(f: EnvFacts) -> str:
    if f.cuda_version:
        return f"CUDA {f.cuda_version} build"
    if f.hip_version:
        return f"ROCm {f.hip_version} build"
    return "CPU-only build"


def check_torch(f: EnvFacts) -> Check:
    """Version at least the minimum, and a build that can use the GPUs the OS shows."""
    found = f"torch {f.torch_version} ({_build(f)}), Python {f.python_version}"
    if _version_tuple(f.torch_version) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        return fail(
            "torch", f"{found}: fsdpkit needs torch >= {need}", f"pip install 'torch>={need}'"
        )
    if not f.cuda_version and not f.hip_version and f.os_gpu_devices:
        return fail(
            "torch",
            f"{found}, but this machine has {f.os_gpu_devices} GPU device(s): every rank "
            "would train on the CPU",
            "install a CUDA (or ROCm) build of torch that matches the driver, e.g. "
            "pip install torch --index-url https://download.pytorch.org/whl/cu128",
        )
    return ok("torch", found)


def check_fsdp2(f: EnvFacts) -> Check:
    if not f.distributed:
        return fail(
            "fsdp2",
            "torch.distributed is not available in this torch build",
            "install an official torch wheel (distributed support is compiled in)",
        )
    if f.fsdp2_error:
        return fail("fsdp2", f"FSDP2 is not importable: {f.fsdp2_error}", "upgrade torch")
    return ok("fsdp2", "torch.distributed.fsdp.fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy")


def check_dcp(f: EnvFacts) -> Check:
    if f.dcp_error:
        return fail(
            "dcp",
            f"distributed checkpointing is incomplete: {f.dcp_error}",
            "upgrade torch (fsdpkit saves with DCP and reads HF weights through it)",
        )
    return ok("dcp", "save/load/async_save, HuggingFaceStorageReader, get/set_state_dict")


def check_backends(f: EnvFacts) -> Check:
    """gloo is always needed (CPU runs, CPU-offload reductions); NCCL with GPUs."""
    if not f.gloo:
        return fail(
            "backends",
            "gloo is not available: CPU runs and CPU-offloaded reductions need it",
            "install an official torch wheel",
        )
    if f.gpus and not f.nccl:
        return fail(
            "backends",
            f"{len(f.gpus)} GPU(s) visible but NCCL is not in this torch build",
            "install a CUDA build of torch (it ships NCCL)",
        )
    if f.nccl:
        return ok("backends", f"gloo, NCCL {f.nccl_version or '(version unknown)'}")
    return ok("backends", "gloo (no NCCL in this build: fine without GPUs)")


def check_devices(f: EnvFacts) -> Check:
    if not f.gpus:
        extra = (
            f" although the OS shows {f.os_gpu_devices} GPU device(s)" if f.os_gpu_devices else ""
        )
        return skip(
            "gpus",
            f"no GPU: torch sees no CUDA/ROCm device{extra}; fsdpkit trains on the CPU with "
            "gloo (correct, slow)",
            "check the driver and CUDA_VISIBLE_DEVICES" if f.os_gpu_devices else "",
        )
    names = sorted({g.name for g in f.gpus})
    listed = ", ".join(
        f"{g.index}: {g.name} {_size(g.total_bytes)} sm_{g.capability[0]}{g.capability[1]}"
        for g in f.gpus
    )
    busy = [g for g in f.gpus if g.free_bytes is not None and g.free_bytes < 0.9 * g.total_bytes]
    if busy:
        used = ", ".join(
            f"GPU {g.index}: {_size(g.total_bytes - (g.free_bytes or 0))}" for g in busy
        )
        return warn(
            "gpus",
            f"{len(f.gpus)} GPU(s) ({listed}); memory already in use by other processes: {used}",
            "stop the other processes (nvidia-smi lists them) or plan with less memory",
        )
    if len(names) > 1:
        return warn(
            "gpus",
            f"mixed GPU models ({listed}): every rank runs at the slowest one's pace and the "
            "smallest one's memory bounds the plan",
            "use CUDA_VISIBLE_DEVICES to select identical GPUs",
        )
    return ok("gpus", f"{len(f.gpus)} x {names[0]} ({listed})")


def check_bf16(f: EnvFacts, *, precision: str = "auto") -> Check:
    """Whether bf16 runs natively where the run will run, against precision.mode."""
    wants_bf16 = precision in ("bf16", "bf16-pure")
    if not f.gpus:
        ratio = f.cpu_bf16_slowdown
        measured = "" if ratio is None else f"; a bf16 matmul takes {ratio:.1f}x the fp32 time here"
        if wants_bf16 and ratio is not None and ratio > 2:
            return warn(
                "bf16",
                f"precision.mode = {precision} on this CPU{measured} (no fast bf16 kernels)",
                "use precision.mode = fp32 (or auto) on this CPU",
            )
        return skip("bf16", f"no GPU{measured}")
    without = [g.index for g in f.gpus if not g.bf16]
    if not without:
        return ok("bf16", "every GPU supports bf16 (precision.mode = auto resolves to bf16)")
    if wants_bf16:
        return fail(
            "bf16",
            f"precision.mode = {precision} but GPU(s) {without} have no bf16 support (pre-Ampere)",
            "use precision.mode = fp16 (with its grad scaler) or fp32",
        )
    return warn(
        "bf16",
        f"GPU(s) {without} have no bf16 support: precision.mode = auto resolves to fp32",
        "use precision.mode = fp16 for mixed precision on these GPUs",
    )


def check_compile(
    *, compile_blocks: bool, gpu: bool, cxx_name: str, cxx: str | None, triton: bool
) -> Check:
    """``train.compile``: inductor needs a C++ compiler (``cxx_name``, found at ``cxx``)
    for CPU kernels and Triton for GPU ones; without them the first step fails deep
    inside torch.compile. ``fsdpkit train`` runs this check before launching."""
    if not compile_blocks:
        return skip("compile", "train.compile is off")
    if gpu:
        if not triton:
            return fail(
                "compile",
                "train.compile = true on GPUs, but Triton (inductor's GPU code generator) "
                "is not installed: the first step would fail inside torch.compile",
                "pip install triton (the version your torch wheel pins), or set "
                "train.compile = false",
            )
        return ok("compile", "inductor on GPU: Triton is installed")
    if cxx is None:
        return fail(
            "compile",
            f"train.compile = true on CPU, but inductor's C++ compiler ({cxx_name}) is not "
            "on PATH: the first step would fail inside torch.compile",
            "install a C++ compiler (e.g. apt install g++) or point CXX at one, or set "
            "train.compile = false",
        )
    return ok("compile", f"inductor on CPU compiles with {cxx}")


def check_p2p(f: EnvFacts) -> Check:
    if len(f.gpus) < 2:
        return skip("p2p", "fewer than 2 local GPUs: no peer-to-peer traffic to check")
    if not f.p2p_missing:
        return ok("p2p", f"all {len(f.gpus)} GPUs can access each other's memory directly")
    pairs = ", ".join(f"{i}->{j}" for i, j in f.p2p_missing[:8])
    more = f" and {len(f.p2p_missing) - 8} more" if len(f.p2p_missing) > 8 else ""
    return warn(
        "p2p",
        f"no peer-to-peer access between GPU pairs {pairs}{more}: NCCL routes that traffic "
        "through host memory (slower all-gathers and reduce-scatters inside the node)",
        "check NVLink/PCIe topology (nvidia-smi topo -m); on PCIe disable ACS/IOMMU "
        "redirection in the BIOS or kernel (iommu=pt); NCCL_P2P_LEVEL changes what NCCL tries",
    )


def check_shm(f: EnvFacts) -> Check:
    """NCCL's intra-node transport and DataLoader workers live in /dev/shm; Docker's
    default is 64 MiB, which NCCL outgrows with a few GPUs ("unhandled system error")."""
    if f.shm_bytes is None:
        return warn(
            "shm",
            "/dev/shm is missing: NCCL's shared-memory transport and multi-process data "
            "loading cannot use it",
            "mount a tmpfs on /dev/shm (docker run --shm-size=16g or --ipc=host)",
        )
    size = _size(f.shm_bytes)
    fix = (
        "docker run --shm-size=16g (or --ipc=host); on Kubernetes mount an emptyDir with "
        "medium: Memory on /dev/shm"
    )
    multi_gpu = len(f.gpus) >= 2
    if f.shm_bytes < 256 * MiB:
        status = fail if multi_gpu else warn
        why = "NCCL fails to extend its segments" if multi_gpu else "too small for data workers"
        return status("shm", f"/dev/shm is {size}: {why}", fix)
    if f.shm_bytes < 1 * GiB and multi_gpu:
        return warn("shm", f"/dev/shm is {size}: tight for NCCL with {len(f.gpus)} GPUs", fix)
    return ok("shm", f"/dev/shm is {size}")


def check_nofile(f: EnvFacts) -> Check:
    """Sockets per peer, checkpoint files and shared-memory tensors all take descriptors."""
    if f.nofile is None:
        return skip("open files", "the open-file limit is unknown on this system")
    soft, hard = f.nofile
    hard_text = "unlimited" if hard < 0 or hard >= 2**62 else str(hard)
    found = f"open-file limit {soft} (hard {hard_text})"
    fix = f"ulimit -n {min(hard, 65536) if 0 < hard < 2**62 else 65536} before launching"
    if 0 <= soft < 1024:
        return fail("open files", f"{found}: sockets and checkpoint files run out", fix)
    if 0 <= soft < 4096:
        return warn("open files", f"{found}: may run out with many ranks or data workers", fix)
    return ok("open files", found)


def check_disk(f: EnvFacts, *, need_bytes: int | None, what: str = "") -> Check:
    """Free space where the run directory will be, against what its checkpoints take."""
    if f.disk_free is None:
        return skip("disk", f"cannot read free space at {f.disk_path}")
    free = f"{_size(f.disk_free)} free at {f.disk_path}"
    if need_bytes is None:
        return ok("disk", f"{free} (give a config to compare with its checkpoint size)")
    if need_bytes == 0:
        return ok("disk", f"{free}; no checkpoints planned (checkpoint.every = 0)")
    need = f"{what or 'checkpoints'} need {_size(need_bytes)}"
    fix = "free space, point logging.run_dir at a bigger disk, or lower checkpoint.keep"
    if f.disk_free < need_bytes:
        return fail("disk", f"{free}, but {need}", fix)
    if f.disk_free < 2 * need_bytes:
        return warn("disk", f"{free}; {need} (less than 2x headroom)", fix)
    return ok("disk", f"{free}; {need}")


def check_clock() -> Check:
    return skip(
        "clock skew",
        "not checkable: one machine has no reference time, and a rendezvous sees network "
        "delay mixed into any offset. Skew does not break training (collectives do not use "
        "wall clocks) but makes per-node logs disagree",
        "run NTP/chrony on every node (chronyc tracking shows the offset)",
    )


def environment_checks(
    f: EnvFacts,
    *,
    precision: str = "auto",
    checkpoint_bytes: int | None = None,
    compile_blocks: bool = False,
) -> list[Check]:
    """Every environment check over ``f`` (environment variables: see ``envvars``)."""

    return [
        check_torch(f),
        check_fsdp2(f),
        check_dcp(f),
        check_backends(f),
        check_devices(f),
        check_bf16(f, precision=precision),
        check_compile(
            compile_blocks=compile_blocks,
            gpu=bool(f.gpus),
            cxx_name=f.cxx_name,
            cxx=f.cxx,
            triton=f.triton,
        ),
        check_p2p(f),
        *check_environ(f),
        check_shm(f),
        check_nofile(f),
        check_disk(f, need_bytes=checkpoint_bytes),
        check_clock(),
    ]
