"""What the checkpoint compatibility fixtures are and how they are checked: shared by
tests/fixtures/checkpoints/make_fixtures.py (which writes them) and
tests/e2e/test_checkpoint_compat.py (which resumes them), so both train with the same overrides.

[Note: canonical format description]
``describe_format`` reduces a checkpoint to what decides whether another fsdpkit can
read it: its file names (rank numbers as ``R``), the keys of ``fsdpkit.json`` (values
vary per run; the resolved config under ``run.config`` is read through the config
loader, whose own compatibility is the config's), and every state-dict entry's key,
dtype and global shape from DCP's ``.metadata``. A change to any of them is a change of
the on-disk format: it must come with a new ``fsdpkit.checkpoint.stepdir.VERSION``.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

FIXTURE_STEP = 2
"""Each fixture holds the checkpoint of this step; a resume trains step FIXTURE_STEP + 1."""

_SMALL = [
    "model.n_layers=1",
    "model.dim=16",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=32",
]
_COMMON = [
    "data.path=corpus.txt",
    "data.seq_len=16",
    "train.global_batch_size=2",
    "train.sample_tokens=0",
    f"checkpoint.every={FIXTURE_STEP}",
    "logging.report=false",
]
FIXTURES: dict[str, dict[str, Any]] = {
    "tiny": {"nproc": 1, "overrides": _SMALL},
    "tiny-async": {"nproc": 2, "overrides": [*_SMALL, "checkpoint.async_save=true"]},
    "hf": {"nproc": 1, "overrides": ["model.hf=hf-llama"]},
    "lora": {
        "nproc": 1,
        "overrides": ["model.hf=hf-llama", "lora.rank=2", "checkpoint.adapters_only=true"],
    },
}
"""name -> launch: the built-in model (sync and async saves), an HF model directory,
LoRA adapters saved alone. Paths are relative to the fixtures directory."""


def train_overrides(name: str, *, steps: int) -> list[str]:
    """The config overrides of fixture ``name`` (run directory ``name``) for ``steps``
    steps, relative to the fixtures directory: a fresh run, or a resume when the run
    directory holds a checkpoint (checkpoint.resume = auto)."""
    spec = FIXTURES[name]
    return [*_COMMON, *spec["overrides"], f"logging.run_dir={name}", f"train.steps={steps}"]


def train_command(name: str, *, steps: int) -> list[str]:
    """``fsdpkit train`` of fixture ``name`` for ``steps`` steps (``train_overrides``),
    run from the fixtures directory."""
    nproc = str(FIXTURES[name]["nproc"])
    return [
        sys.executable,
        "-m",
        "fsdpkit",
        "train",
        "--nproc",
        nproc,
        *train_overrides(name, steps=steps),
    ]


def metrics_loss(path: Path, step: int) -> float:
    """The training loss metrics.jsonl records for ``step``."""
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("step") == step and "loss" in record:
            return float(record["loss"])
    raise AssertionError(f"{path} has no loss for step {step}")


def _keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        out.append(name)
        if isinstance(value, dict) and name not in ("files", "run.config"):
            out.extend(_keys(value, f"{name}."))
    return out


def describe_format(ckpt: Path) -> dict[str, Any]:
    """[Note: canonical format description] of the checkpoint directory ``ckpt``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fsdpkit.checkpoint.stepdir import read_meta
    from fsdpkit.checkpoint.untrusted import read_metadata

    meta = read_meta(ckpt)
    entries = read_metadata(ckpt, meta).state_dict_metadata
    tensors = {
        key: [str(md.properties.dtype).removeprefix("torch."), list(md.size)]
        for key, md in sorted(entries.items())
        if isinstance(md, TensorStorageMetadata)
    }
    return {
        "files": sorted({re.sub(r"^__\d+_", "__R_", p.name) for p in ckpt.iterdir()}),
        "marker_keys": sorted(_keys(meta)),
        "tensors": tensors,
        "objects": sorted(k for k in entries if k not in tensors),
    }


def export_digest(ckpt: Path, *, name: str) -> dict[str, str]:
    """sha256 of every tensor ``fsdpkit ckpt export`` writes from ``ckpt`` (the peft
    adapter for an adapters-only checkpoint, else the one torch file)."""
    import torch
    from safetensors.torch import load_file

    from fsdpkit.export import export

    with tempfile.TemporaryDirectory() as tmp:
        if name == "lora":
            out = export(ckpt, Path(tmp) / "adapter", fmt="peft")
            tensors = load_file(str(out / "adapter_model.safetensors"))
        else:
            out = export(ckpt, Path(tmp) / "weights.pt", fmt="torch")
            tensors = torch.load(out, weights_only=True)
    return {
        key: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
        for key, t in sorted(tensors.items())
    }
