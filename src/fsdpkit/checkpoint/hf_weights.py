"""Loading Hugging Face safetensors into an already-sharded (or plain) model.

Generic DCP: ``HuggingFaceStorageReader`` reads each rank's slices of its own shards,
so no rank holds the full model. Used by ``model.hf`` (the model's initializer) and
``model.init_from``; exporting to HF files is ``fsdpkit.export``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from fsdpkit.checkpoint.errors import CheckpointError, dcp_errors_as
from fsdpkit.checkpoint.state import tied_aliases

log = logging.getLogger(__name__)


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


def _check_hf(
    sd: dict[str, Any],
    available: dict[str, Any],
    path: Path,
    *,
    aliases: dict[str, str],
    allow_missing: bool,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The entries of ``sd`` to read from ``path`` and the ones it lacks; shapes must match."""
    wanted = {k: v for k, v in sd.items() if k not in aliases}
    missing = [k for k in wanted if k not in available]
    if missing and (not allow_missing or len(missing) == len(wanted)):
        raise CheckpointError(
            f"{path} lacks {len(missing)} of the {len(wanted)} weight(s) the model needs "
            f"(e.g. {missing[:3]}); it was saved from a different architecture or is "
            "incomplete. Point the model at a directory whose weights match its config.json."
        )
    for key, value in wanted.items():
        md = available.get(key)
        if isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(value.shape):
            raise CheckpointError(
                f"{path}: {key} has shape {tuple(md.size)} but the model expects "
                f"{tuple(value.shape)}; the model config does not match these weights."
            )
    return {k: v for k, v in wanted.items() if k not in missing}, missing


def load_hf_weights(
    model: nn.Module, path: str | Path, *, allow_missing: bool = False
) -> list[str]:
    """Fill an already-sharded (or plain) model from an HF safetensors directory.

    Collective when distributed: every rank reads only the slices of its own shards
    (HuggingFaceStorageReader + DCP), so no rank ever holds the full model. Weights are
    cast to the parameters' dtype. Tied heads may be absent from the files. With
    ``allow_missing``, weights absent from the files are left as they are and their
    names returned (the caller initializes them); otherwise they are an error."""
    path = Path(path)
    refuse_quantized(path, field="model.init_from")
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise CheckpointError(
            f"{str(path)!r} is not a directory of .safetensors files. Point model.init_from "
            "(or model.hf) at an HF model directory (e.g. the output of `fsdpkit ckpt export`)."
        )
    sd = get_model_state_dict(model)
    aliases = tied_aliases(model)  # [Note: tied weights]: read once, share
    available = HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata
    wanted, missing = _check_hf(sd, available, path, aliases=aliases, allow_missing=allow_missing)
    unused = sorted(set(available) - set(sd))
    if unused:
        log.warning(
            "%s holds %d tensor(s) the model has no parameter or buffer for (e.g. %s); "
            "they are not loaded.",
            path,
            len(unused),
            unused[:3],
        )
    with dcp_errors_as(
        lambda cause: (
            f"reading HF weights from {path} failed: {cause}. Check that the "
            "files are complete (re-download or re-export them)."
        )
    ):
        dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(path)))
    for alias, name in aliases.items():
        sd[alias] = sd[name]
    set_model_state_dict(model, sd)
    return missing
