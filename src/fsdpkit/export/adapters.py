"""LoRA checkpoints to files others load: a peft adapter directory, or merged weights.

``fsdpkit ckpt export CKPT --format peft OUT`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` as ``peft`` saves them (keys
``base_model.model.<layer>.lora_A.weight``, the modules trained in full as
``modules_to_save``), so ``PeftModel.from_pretrained(base, OUT)`` puts the adapters on
the base model. ``--merge --format hf OUT`` writes the base with every adapter folded
in, ``W + (alpha / r) * B @ A`` (transposed for transformers' Conv1D, which stores
``W`` as in x out), computed in fp32 one output shard at a time, under the base
model's own names: ``from_pretrained`` loads it without peft.

The base weights come from the checkpoint when it holds them; an adapters-only
checkpoint (``checkpoint.adapters_only``) reads them from where the run did:
``model.init_from``, else the ``model.hf`` directory. Everything read from
``fsdpkit.json`` is type-checked before use, and the DCP data goes through the same
checksum-gated reader as every other export ([Note: untrusted checkpoints]).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import (
    TensorProperties,
    TensorStorageMetadata,
)

from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.finetune.lora import peft_module

ADAPTER = ".default."
"""peft's adapter name inside parameter names (never in exported files)."""

Items = dict[str, tuple[Any, TensorStorageMetadata]]
"""Output name -> (checkpoint key, or None when read from the base directory; size)."""


def lora_record(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The LoRA facts a checkpoint recorded (None: no adapters), type-checked."""
    run = meta.get("run", {}) if isinstance(meta.get("run"), dict) else {}
    record = run.get("finetune")
    if record is None:
        return None
    lora = run.get("config", {}).get("lora", {}) if isinstance(run.get("config"), dict) else {}
    ok = (
        isinstance(record, dict)
        and all(_strings(record.get(k)) for k in ("lora_targets", "conv1d", "modules_to_save"))
        and isinstance(lora.get("rank"), int)
        and lora["rank"] > 0
        and isinstance(lora.get("alpha"), int | float)
        and isinstance(lora.get("dropout"), int | float)
    )
    if not ok:
        raise CheckpointError(
            "the checkpoint's fsdpkit.json has a malformed LoRA record (finetune / "
            "config.lora); the marker is damaged or was not written by fsdpkit."
        )
    return {
        **record,
        "rank": lora["rank"],
        "alpha": float(lora["alpha"]),
        "dropout": float(lora["dropout"]),
    }


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_key(name: str) -> str:
    """File key of an adapter (or fully trained) parameter in a peft adapter file."""
    return "base_model.model." + name.replace(ADAPTER, ".")


def _model_hf(meta: dict[str, Any]) -> str | None:
    hf = meta.get("run", {}).get("config", {}).get("model", {}).get("hf")
    return hf if isinstance(hf, str) else None


def _tied(meta: dict[str, Any]) -> dict[str, str]:
    """``{alias: name}`` of tied parameters recorded with the checkpoint (type-checked)."""
    tied = meta.get("state", {}).get("tied", {})
    if not isinstance(tied, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tied.items()
    ):
        raise CheckpointError("the checkpoint's fsdpkit.json has a malformed 'tied' record.")
    return tied


def modules_to_save(record: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """``lora.trainable`` modules plus the modules tied to them ([Note: tied modules to
    save]): peft wraps each module to save in a copy of its own, so a trained embedding
    tied to the head must travel as both, or the head would keep the base's weights."""
    saved = list(record["modules_to_save"])
    for alias, name in _tied(meta).items():
        owner, other = name.rpartition(".")[0], alias.rpartition(".")[0]
        if owner in saved and other not in saved:
            saved.append(other)
    return saved


def peft_items(items: Items, record: dict[str, Any], meta: dict[str, Any]) -> Items:
    """The checkpoint entries a peft adapter directory holds, under peft's file keys.

    [Note: tied modules to save]
    A tied parameter is stored once (under its first name); when its module is trained
    in full, the adapter file carries it under every tied name, and each of those
    modules is in ``modules_to_save``, so peft's copies start equal, as the trained
    model's shared weight. (peft's own ``ensure_weight_tying`` recognizes only
    ``embed_tokens`` / ``lm_head``, not GPT-2's ``wte``.)"""
    owners = tuple(f"{m}." for m in record["modules_to_save"])
    chosen = {n: v for n, v in items.items() if is_adapter(n) or n.startswith(owners)}
    for alias, name in _tied(meta).items():
        if name in chosen:
            chosen[alias] = chosen[name]
    missing = [t for t in record["lora_targets"] if f"{t}.lora_A{ADAPTER}weight" not in chosen]
    if missing:
        raise CheckpointError(
            f"the checkpoint records LoRA adapters on {missing[0]!r} but holds no "
            "lora_A weight for it; it is damaged or was not written by fsdpkit."
        )
    return {peft_key(n): v for n, v in chosen.items()}


def write_peft_config(out: Path, record: dict[str, Any], meta: dict[str, Any]) -> None:
    """``adapter_config.json`` through peft's own ``LoraConfig.save_pretrained``."""

    peft = peft_module()
    targets, conv1d = record["lora_targets"], record["conv1d"]
    hf = _model_hf(meta)
    config = peft.LoraConfig(
        r=record["rank"],
        lora_alpha=record["alpha"],
        lora_dropout=record["dropout"],
        target_modules=targets,
        modules_to_save=modules_to_save(record, meta) or None,
        fan_in_fan_out=bool(conv1d) and len(conv1d) == len(targets),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(Path(hf).expanduser().resolve()) if hf else None,
    )
    config.save_pretrained(str(out))


def write_peft_weights(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``adapter_model.safetensors`` (a tied tensor saved under each name: a copy each,
    as safetensors stores no shared memory)."""
    seen: set[int] = set()
    own = {}
    for key, t in tensors.items():
        t = t.contiguous()
        own[key] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    save_file(own, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- merge


def base_weights_dir(meta: dict[str, Any]) -> Path:
    """Where an adapters-only run's base weights are: model.init_from, else model.hf."""
    model = meta.get("run", {}).get("config", {}).get("model", {})
    for key in ("init_from", "hf"):
        value = model.get(key) if isinstance(model, dict) else None
        if isinstance(value, str) and any(Path(value).expanduser().glob("*.safetensors")):
            return Path(value).expanduser()
    raise CheckpointError(
        "this checkpoint holds only the adapters (checkpoint.adapters_only) and its run "
        "took the base weights from no safetensors directory (model.init_from / model.hf "
        "missing or without *.safetensors: a random init), so there is no base to merge "
        "into. Export the adapters with --format peft, or merge from a full checkpoint."
    )


def _dir_index(folder: Path) -> dict[str, tuple[Path, TensorStorageMetadata]]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                sl = f.get_slice(key)
                dtype = _DTYPES.get(sl.get_dtype())
                if dtype is not None:
                    md = TensorStorageMetadata(
                        TensorProperties(dtype=dtype), torch.Size(sl.get_shape()), []
                    )
                    out[key] = (file, md)
    return out


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


ReadDCP = Callable[[Items], dict[str, torch.Tensor]]
"""Loads checkpoint entries (name -> (key, size)) into tensors keyed by name."""


def merged_reader(
    items: Items, record: dict[str, Any] | None, meta: dict[str, Any], *, read_dcp: ReadDCP
) -> tuple[Items, ReadDCP]:
    """(the tensors a merged export writes, under the base model's names; a reader that
    loads one shard of them with the adapters folded in). Without a LoRA ``record`` (an
    adapters-only checkpoint of a ``model.freeze`` run) the trained parameters are laid
    over the base read from its files."""
    record = record or {"alpha": 1.0, "rank": 1, "conv1d": [], "lora_targets": []}
    base: Items = {n.replace(".base_layer.", "."): v for n, v in items.items() if not is_adapter(n)}
    files: dict[str, Path] = {}
    if meta.get("state", {}).get("trainable_only"):
        for name, (file, md) in _dir_index(base_weights_dir(meta)).items():
            if name not in base:
                base[name] = (None, md)
                files[name] = file
    scale = record["alpha"] / record["rank"]
    conv1d = set(record["conv1d"])
    layers = {f"{t}.weight": t for t in record["lora_targets"]}

    def read(shard: Items) -> dict[str, torch.Tensor]:
        wanted = {n: v for n, v in shard.items() if v[0] is not None}
        for name in shard:
            if name in layers:
                for kind in ("lora_A", "lora_B"):
                    key = f"{layers[name]}.{kind}{ADAPTER}weight"
                    wanted[key] = items[key]
        loaded = read_dcp(wanted)
        loaded.update(_read_files([n for n in shard if n in files], files))
        out = {}
        for name in shard:
            value = loaded[name]
            if name in layers:
                a = loaded[f"{layers[name]}.lora_A{ADAPTER}weight"].double()
                b = loaded[f"{layers[name]}.lora_B{ADAPTER}weight"].double()
                delta = scale * (b @ a)
                merged = value.double() + (delta.t() if layers[name] in conv1d else delta)
                value = merged.to(torch.float32)
            out[name] = value
        return out

    return base, read


def _read_files(names: list[str], files: dict[str, Path]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        with safe_open(str(files[name]), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def check_lora_export(meta: dict[str, Any], *, fmt: str, merge: bool) -> dict[str, Any] | None:
    """The LoRA record when the export needs it; errors for what cannot be exported."""
    record = lora_record(meta)
    if fmt == "peft" and record is None:
        raise CheckpointError(
            "--format peft exports LoRA adapters, but this checkpoint's run had none "
            "(lora.rank = 0). Export the weights with --format hf."
        )
    if record is not None and fmt == "hf" and not merge:
        raise CheckpointError(
            "this checkpoint holds LoRA adapters beside a frozen base: export the adapters "
            "with --format peft (a peft adapter directory), or the merged weights with "
            "--merge --format hf (loadable by from_pretrained without peft)."
        )
    if merge and (record is None or fmt != "hf"):
        raise CheckpointError(
            "--merge folds LoRA adapters into the base weights: it needs a checkpoint with "
            "adapters and --format hf."
        )
    if fmt == "torch" and meta.get("state", {}).get("trainable_only"):
        raise CheckpointError(
            "this checkpoint holds only the trainable parameters (checkpoint.adapters_only), "
            "so a torch file of it would miss the frozen base. Export with --format hf "
            "(the base is read from the run's model.hf / model.init_from) or, for LoRA "
            "runs, --format peft."
        )
    return record
