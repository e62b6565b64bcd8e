"""Loading Hugging Face safetensors into an already-sharded (or plain) model.

Generic DCP: ``HuggingFaceStorageReader`` reads each rank's slices of its own shards,
so no rank holds the full model. Used by ``model.hf`` (the model's initializer) and
``model.init_from``; exporting to HF files is ``fsdpkit.export``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from fsdpkit.checkpoint.errors import CheckpointError, dcp_errors_as
from fsdpkit.checkpoint.hf_convert import KeyPlan, plan_keys, read_group
from fsdpkit.checkpoint.quantized import refuse_quantized
from fsdpkit.checkpoint.statefuls import tied_aliases

log = logging.getLogger(__name__)


class MissingWeightsError(CheckpointError):
    """A directory holds weights, but not every weight the model needs."""


def missing_weights_message(
    path: Path, *, missing: list[str], unexpected: list[str], total: int, absent: list[str]
) -> str:
    """One paragraph: which weights a directory lacks, which it holds that the model has
    no place for, and the fix."""
    extra = (
        f" It also holds {len(unexpected)} tensor(s) the model has no place for "
        f"(e.g. {unexpected[:5]})."
        if unexpected
        else ""
    )
    pieces = (
        f" Of the per-expert (or split) tensors they are made of, it lacks {absent[:5]}."
        if absent
        else ""
    )
    return (
        f"{path} lacks {len(missing)} of the {total} weight(s) the model needs (e.g. "
        f"{missing[:5]}), after transformers' own renames and conversions of this "
        f"family.{pieces}{extra} The directory was saved from a different architecture or "
        "version, or is incomplete: point model.hf at a directory written by "
        "save_pretrained for this config.json (or re-download it). To train with the "
        "missing weights freshly initialized on purpose, set model.init_missing = true."
    )


def _check_shapes(wanted: dict[str, Any], shapes: dict[str, torch.Size], path: Path) -> None:
    for key, value in wanted.items():
        size = shapes.get(key)
        if size is not None and tuple(size) != tuple(value.shape):
            raise CheckpointError(
                f"{path}: {key} has shape {tuple(size)} but the model expects "
                f"{tuple(value.shape)}; the model config does not match these weights."
            )


def _file_of(path: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it (headers only)."""
    from safetensors import safe_open

    files: dict[str, Path] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), file))
    return files


class _Slices:
    """Lazily read safetensors slices, each file opened once."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.open: dict[Path, Any] = {}

    def __call__(self, key: str) -> Any:
        from safetensors import safe_open

        file = self.files[key]
        if file not in self.open:
            self.open[file] = safe_open(str(file), framework="pt")
        return self.open[file].get_slice(key)


@dataclass(frozen=True)
class LoadReport:
    """What ``load_hf_weights`` found."""

    missing: list[str]
    """Model weights the directory lacks (left as they were)."""
    unexpected: list[str]
    """Directory tensors the model has no place for (not loaded)."""
    converted: bool
    """Whether transformers' conversions renamed or fused anything."""


def load_hf_weights(
    model: nn.Module,
    path: str | Path,
    *,
    allow_missing: bool = False,
    shadow: nn.Module | None = None,
) -> LoadReport:
    """Fill an already-sharded (or plain) model from an HF safetensors directory.

    Collective when distributed. Keys are mapped as ``from_pretrained`` maps them
    (``shadow``: the same transformers model unsharded, on meta; [Note: one loading
    rule with transformers]); tensors that keep their shape under a rename are read by
    DCP (``HuggingFaceStorageReader``: each rank only its own slices), converted ones
    one group at a time. Weights are cast to the parameters' dtype. Tied heads may be
    absent from the files. Missing weights are an error (``MissingWeightsError``)
    unless ``allow_missing``: then they are left as they are and reported."""
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
    shapes = {
        k: (md.size, md.properties.dtype)
        for k, md in available.items()
        if isinstance(md, TensorStorageMetadata)
    }
    plan = (
        plan_keys(shadow, shapes)
        if shadow is not None
        else KeyPlan(renamed={k: k for k in shapes if k in sd}, groups=[], unexpected=[])
    )
    if shadow is None:
        plan.unexpected.extend(sorted(set(shapes) - set(sd)))
    wanted = {k: v for k, v in sd.items() if k not in aliases}
    produced = plan.produced()
    missing = [k for k in wanted if k not in produced]
    unexpected = [k for k in plan.unexpected if k not in aliases]
    if missing and (not allow_missing or len(missing) == len(wanted)):
        raise MissingWeightsError(
            missing_weights_message(
                path, missing=missing, unexpected=unexpected, total=len(wanted), absent=plan.absent
            )
        )
    _check_shapes(wanted, {t: shapes[c][0] for t, c in plan.renamed.items()}, path)
    _check_shapes(wanted, {k: s for g in plan.groups for k, s in g.targets.items()}, path)
    if unexpected:
        log.warning(
            "%s holds %d tensor(s) the model has no parameter or buffer for (e.g. %s); "
            "they are not loaded.",
            path,
            len(unexpected),
            unexpected[:3],
        )
    renamed = {plan.renamed[k]: v for k, v in wanted.items() if k in plan.renamed}
    with dcp_errors_as(
        lambda cause: (
            f"reading HF weights from {path} failed: {cause}. Check that the "
            "files are complete (re-download or re-export them)."
        )
    ):
        dcp.load(renamed, storage_reader=HuggingFaceStorageReader(str(path)))
        # a pipeline stage holds some layers only: the groups of the others are not read
        groups = [g for g in plan.groups if any(t in sd for t in g.targets)]
        slices = _Slices(_file_of(path)) if groups else None
        tensors = cast(dict[str, torch.Tensor], sd)  # the model's: tensors, plain or DTensor
        for group in groups:
            assert shadow is not None  # groups come from plan_keys(shadow, ...)
            read_group(shadow, group, open_slice=slices, params=tensors)
    for alias, name in aliases.items():
        sd[alias] = sd[name]
    set_model_state_dict(model, sd)
    return LoadReport(missing=missing, unexpected=unexpected, converted=plan.converted())
