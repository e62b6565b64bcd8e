"""Offline export of a checkpoint's model weights: HF safetensors or one torch file.

Runs in one process without a process group, reading the DCP checkpoint directly.
A ``model.hf`` run exports its own parameter names with the training directory's
config.json, generation config and tokenizer files, so ``from_pretrained`` loads it.
HF export streams: it loads one output shard's tensors at a time (DCP reads only those
byte ranges), so peak memory is one shard (``max_shard_bytes``), not the model.
"""

from __future__ import annotations

import dataclasses
import json
import re
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.hf_convert import export_groups, to_checkpoint_layout
from fsdpkit.checkpoint.reader import VerifyingReader
from fsdpkit.checkpoint.statefuls import model_prefix
from fsdpkit.checkpoint.stepdir import quiet_single_process, read_meta, verify
from fsdpkit.checkpoint.untrusted import SafeLoadPlanner, read_metadata
from fsdpkit.export import adapters
from fsdpkit.export.adapters import ReadDCP
from fsdpkit.export.hf_files import (
    HEAD,
    copy_hf_model_files,
    hf_config,
    hf_model_files,
    llama_config,
)
from fsdpkit.models.hf.construct import construct
from fsdpkit.models.hf.directory import read_hf_dir

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INDEX = "model.safetensors.index.json"


def dcp_tensors(ckpt: Path) -> dict[str, TensorStorageMetadata]:
    """Every tensor in a DCP checkpoint (``.metadata`` checked against its recorded
    crc32 and read with the restricted unpickler: fsdpkit.checkpoint.untrusted)."""
    md = read_metadata(Path(ckpt), read_meta(ckpt))
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def model_tensors(ckpt: Path) -> dict[str, tuple[str, TensorStorageMetadata]]:
    """Model weights: HF-style name -> (checkpoint key, metadata), in natural order."""
    meta = read_meta(ckpt)
    tensors = dcp_tensors(ckpt)
    prefix = model_prefix(meta, list(tensors))
    names = {k[len(prefix) :]: (k, v) for k, v in tensors.items() if k.startswith(prefix)}
    return dict(sorted(names.items(), key=lambda kv: _natural(kv[0])))


def _natural(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _read(ckpt: Path, items: dict[str, tuple[str, TensorStorageMetadata]]) -> dict[str, Any]:
    """Load just these tensors from the DCP checkpoint, keyed by their HF names."""
    sd = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in items.values()}
    meta = read_meta(ckpt)
    reader = VerifyingReader(ckpt, metadata=read_metadata(ckpt, meta), records=meta["files"])
    with quiet_single_process():
        dcp.load(sd, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return {name: sd[key] for name, (key, _) in items.items()}


def _shards(
    items: dict[str, tuple[str, TensorStorageMetadata]],
    *,
    itemsize: int | None,
    limit: int,
    together: list[list[str]] | None = None,
) -> list[dict[str, tuple[str, TensorStorageMetadata]]]:
    """Output shards of at most ``limit`` bytes; the names of one ``together`` set
    (what one reverse conversion needs) always land in one shard."""
    shards: list[dict[str, tuple[str, TensorStorageMetadata]]] = [{}]
    size = 0
    for names in together or [[name] for name in items]:
        nbytes = sum(
            items[n][1].size.numel() * (itemsize or items[n][1].properties.dtype.itemsize)
            for n in names
        )
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1].update({n: items[n] for n in names})
        size += nbytes
    return shards


def _check_target(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(
            f"export target {out} already exists and is not an empty directory; choose a "
            "new or empty directory."
        )


def _write_shards(
    ckpt: Path,
    out: Path,
    items: dict[str, tuple[str, TensorStorageMetadata]],
    *,
    dtype: torch.dtype | None,
    max_shard_bytes: int,
    read: ReadDCP | None = None,
    shadow: Any = None,
) -> None:
    """Safetensors shards + index, one shard's tensors in memory at a time (``read``
    loads a shard; default: straight from the checkpoint). With ``shadow`` (the
    run's transformers model, on meta) the tensors are written in the layout its
    ``save_pretrained`` writes ([Note: one loading rule with transformers])."""
    itemsize = dtype.itemsize if dtype is not None else None
    together = export_groups(shadow, list(items)) if shadow is not None else None
    shards = _shards(items, itemsize=itemsize, limit=max_shard_bytes, together=together)
    load = read or partial(_read, ckpt)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        loaded = load(shard)
        if shadow is not None:
            loaded = to_checkpoint_layout(shadow, loaded)
        tensors = {n: t.to(dtype or t.dtype).contiguous() for n, t in loaded.items()}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _export_hf(
    ckpt: Path, out: Path, *, dtype: torch.dtype | None, max_shard_bytes: int, merge: bool
) -> Path:
    meta = read_meta(ckpt)
    run = meta.get("run", {})
    items: Any = model_tensors(ckpt)
    read = None
    record = adapters.check_lora_export(meta, fmt="hf", merge=merge)
    overlay = record is not None or meta.get("state", {}).get("trainable_only")
    if overlay:  # adapters folded in / trained parameters over the base, base names
        items, read = adapters.merged_reader(items, record, meta, read_dcp=partial(_read, ckpt))
    saved_dtype = next(iter(items.values()))[1].properties.dtype
    dtype = dtype or (saved_dtype if overlay else None)
    if run.get("config", {}).get("model", {}).get("hf"):
        files = hf_model_files(ckpt, run)  # before writing anything: it may refuse
        _check_target(out)
        out.mkdir(parents=True, exist_ok=True)
        shadow = construct(read_hf_dir(files["config.json"].parent).config)
        _write_shards(
            ckpt, out, items, dtype=dtype, max_shard_bytes=max_shard_bytes, read=read, shadow=shadow
        )
        copy_hf_model_files(files, out, dtype=dtype or saved_dtype)
        return out
    cfg = llama_config(run, {n: md.size for n, (_, md) in items.items()})
    if HEAD not in items:  # saved once as the embedding ([Note: tied weights])
        cfg = dataclasses.replace(cfg, tie_embeddings=True)
    if cfg.tie_embeddings:
        items.pop(HEAD, None)
    config = hf_config(cfg, dtype=dtype or saved_dtype)  # before writing: it may refuse
    _check_target(out)
    out.mkdir(parents=True, exist_ok=True)
    builtin_shadow = moe_shadow(config) if config["model_type"] != "llama" else None
    _write_shards(
        ckpt, out, items, dtype=dtype, max_shard_bytes=max_shard_bytes, read=read,
        shadow=builtin_shadow,
    )  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def moe_shadow(config: dict[str, Any]) -> Any:
    """The transformers model of the built-in MoE's config.json, on meta: its reverse
    conversion writes the per-expert layout ``save_pretrained`` writes."""
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    return construct(AutoConfig.for_model(**fields))


def _export_peft(ckpt: Path, out: Path, *, dtype: torch.dtype | None) -> Path:
    meta = read_meta(ckpt)
    record = adapters.check_lora_export(meta, fmt="peft", merge=False)
    assert record is not None
    chosen = adapters.peft_items(model_tensors(ckpt), record, meta)
    _check_target(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: t.to(dtype or t.dtype) for k, t in _read(ckpt, chosen).items()}
    adapters.write_peft_weights(out, tensors)
    adapters.write_peft_config(out, record, meta)
    return out


def _export_torch(ckpt: Path, out: Path, *, dtype: torch.dtype | None) -> Path:
    target = out / "model.pt" if out.is_dir() else out
    if target.exists():
        raise CheckpointError(f"export target {target} already exists; choose a new file name.")
    tensors = {n: t.to(dtype or t.dtype) for n, t in _read(ckpt, model_tensors(ckpt)).items()}
    for alias, name in read_meta(ckpt).get("state", {}).get("tied", {}).items():
        tensors.setdefault(alias, tensors[name])  # loadable with load_state_dict(strict=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(tensors, target)
    return target


def export(
    ckpt_path: str | Path,
    out: str | Path,
    *,
    fmt: str = "hf",
    dtype: str | None = None,
    max_shard_bytes: int = 5 << 30,
    merge: bool = False,
) -> Path:
    """Write a checkpoint's model weights as HF safetensors (``fmt="hf"``: shards,
    ``model.safetensors.index.json``, ``config.json``; of a LoRA run only with
    ``merge``: adapters folded into the base), one torch file (``fmt="torch"``: a state
    dict loadable with ``torch.load(..., weights_only=True)``) or a peft adapter
    directory (``fmt="peft"``, fsdpkit.export.adapters). ``dtype``: bf16, fp16, fp32
    or None (as saved). Returns the path written."""
    ckpt = Path(ckpt_path)
    report = verify(ckpt, metadata=True)
    if not report.ok:
        raise CheckpointError(f"cannot export: {report.describe()}")
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}.")
    torch_dtype = DTYPES[dtype] if dtype else None
    if fmt not in ("hf", "torch", "peft"):
        raise CheckpointError(f"unknown export format {fmt!r}; choose hf, peft or torch.")
    if fmt == "torch" or (merge and fmt != "hf"):
        adapters.check_lora_export(read_meta(ckpt), fmt=fmt, merge=merge)
    if fmt == "hf":
        return _export_hf(
            ckpt, Path(out), dtype=torch_dtype, max_shard_bytes=max_shard_bytes, merge=merge
        )
    if fmt == "peft":
        return _export_peft(ckpt, Path(out), dtype=torch_dtype)
    return _export_torch(ckpt, Path(out), dtype=torch_dtype)
