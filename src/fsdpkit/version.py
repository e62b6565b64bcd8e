"""The fsdpkit version (the one source of truth) and the versions of what it runs on.

``pyproject.toml`` reads ``__version__`` from this file (setuptools'
``dynamic = ["version"]``, parsed without importing anything), so the wheel, ``fsdpkit
--version``, ``config.toml``, ``hardware.json``, the first metrics record and every
checkpoint's ``fsdpkit.json`` all say the same version. A leaf: it imports no other
fsdpkit module, so every layer may record which fsdpkit wrote what it writes.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

__version__ = "0.1.0"


def _installed(name: str) -> str | None:
    """An installed distribution's version without importing it (transformers takes
    seconds to import), or None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def written_by() -> dict[str, str]:
    """What every file fsdpkit writes records about its writer: the fsdpkit and torch
    versions (a checkpoint or run from another release can then be told apart)."""
    import torch

    return {"fsdpkit_version": __version__, "torch_version": str(torch.__version__)}


def version_info() -> dict[str, Any]:
    """fsdpkit, Python, torch and the optional libraries a run may use, with the CUDA
    and NCCL versions torch was built with (None on a CPU build or when absent): what a
    bug report needs (``fsdpkit version --json``). The CUDA/NCCL lines have not yet been
    run on a GPU build."""
    import platform

    import torch

    cuda = torch.version.cuda
    nccl = None
    if cuda and torch.distributed.is_available() and torch.distributed.is_nccl_available():
        found = torch.cuda.nccl.version()  # a (major, minor, patch) tuple; an int before
        nccl = ".".join(map(str, found)) if isinstance(found, tuple) else str(found)
    return {
        "fsdpkit": __version__,
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "cuda": cuda,
        "nccl": nccl,
        "cuda_available": torch.cuda.is_available(),
        "transformers": _installed("transformers"),
        "peft": _installed("peft"),
        "safetensors": _installed("safetensors"),
        "numpy": _installed("numpy"),
    }
