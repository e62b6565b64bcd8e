"""What the run ran on, written once by rank 0 as ``hardware.json`` so a report made
later (or on another machine) still says it."""

from __future__ import annotations

import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

import torch

from fsdpkit.observe.runlog import HARDWARE_FILE
from fsdpkit.runtime.distenv import DistEnv
from fsdpkit.version import __version__


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * size / 2**30, 1)


def describe(env: DistEnv) -> dict[str, Any]:
    """Host, CPU, memory, accelerators and software versions of this process."""
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "world_size": env.world_size,
        "ranks_per_node": env.local_world_size,
        "device_type": env.device_type,
        "fsdpkit": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": platform.platform(),
    }
    if env.device_type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(env.local_rank)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    else:
        info["threads_per_rank"] = torch.get_num_threads()
    return info


def write(run_dir: Path, env: DistEnv) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / HARDWARE_FILE).write_text(json.dumps(describe(env), indent=2) + "\n")
