"""Quantized model directories, refused before anything is built or read ([Note:
quantized checkpoints]). Reads config.json only, so checking a directory (the
launcher, the planner) imports no checkpoint reader.
"""

from __future__ import annotations

import json
from pathlib import Path

from fsdpkit.checkpoint.errors import CheckpointError


class QuantizedCheckpointError(CheckpointError):
    """A quantized model directory (bitsandbytes, GPTQ, AWQ, fp8, ...): refused."""


def quantization_of(directory: Path) -> str | None:
    """What a model directory's ``config.json`` says is quantized, in words (None: not
    quantized, or no readable config.json)."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if not quant:
        return None
    if not isinstance(quant, dict):
        return "quantization_config present"
    method = quant.get("quant_method") or (
        "bitsandbytes" if quant.get("load_in_4bit") or quant.get("load_in_8bit") else "unknown"
    )
    bits = quant.get("bits") or (4 if quant.get("load_in_4bit") else None)
    bits = bits or (8 if quant.get("load_in_8bit") else None)
    what = quant.get("fmt") or quant.get("quant_type") or quant.get("bnb_4bit_quant_type")
    details = ", ".join(str(x) for x in (f"{bits}-bit" if bits else None, what) if x)
    return f"quant_method {method!r}" + (f" ({details})" if details else "")


def refuse_quantized(directory: Path, *, field: str) -> None:
    """[Note: quantized checkpoints]
    fsdpkit trains full-precision weights and has no QLoRA. A quantized checkpoint's
    tensors are packed integers with scales (GPTQ, AWQ, bitsandbytes 4/8-bit) or fp8
    with per-tensor scales: read into bf16/fp32 parameters they are garbage, and other
    FSDP2 stacks train them silently to a loss of 0.0 or NaN gradient norms. Such a
    directory is refused by name before anything is built or read."""
    quantized = quantization_of(directory)
    if quantized is None:
        return
    raise QuantizedCheckpointError(
        f"{field} = {str(directory)!r} is a quantized checkpoint (config.json "
        f"quantization_config: {quantized}). fsdpkit trains bf16/fp16/fp32 weights and "
        "has no QLoRA, so it cannot train or load these weights. Point it at the "
        "original bf16/fp16 checkpoint of the model (the one it was quantized from), "
        "or dequantize once (transformers: model.dequantize(); save_pretrained) and use "
        "that directory."
    )
