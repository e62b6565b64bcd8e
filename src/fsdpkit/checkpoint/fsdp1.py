"""FSDP1 checkpoints into an already-sharded fsdpkit model (``model.init_from``).

Two kinds, as FSDP1 (and Accelerate on top of it) write them:

- SHARDED_STATE_DICT: a DCP directory (``.metadata`` + ``__N_M.distcp``), usually the
  model under a ``model.`` key (Accelerate: ``OUTPUT/pytorch_model_fsdp_0``). Every
  rank reads only the pieces of its own shards (DCP reshards on load), at any world
  size and mesh.
- FULL_STATE_DICT: one torch file (Accelerate: ``OUTPUT/pytorch_model_fsdp.bin``),
  read with ``torch.load(weights_only=True, mmap=True)`` so nothing in it can run
  code; each rank keeps its slice.

Keys are matched after removing wrapper names (``_fsdp_wrapped_module.``,
``_checkpoint_wrapped_module.``, ``_orig_mod.``, a DDP ``module.`` prefix) and the
prefix the checkpoint nests the model under (found by matching the model's own
names). Anything that does not map is an error listing the missing and unexpected
keys and naming every shape mismatch; tied aliases (a tied output head) are optional.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from fsdpkit.checkpoint.errors import CheckpointError, dcp_errors_as
from fsdpkit.checkpoint.statefuls import tied_aliases
from fsdpkit.checkpoint.untrusted import RestrictedReader, SafeLoadPlanner

Kind = Literal["dcp", "torch"]
ACCELERATE_SHARDED = "pytorch_model_fsdp_0"
ACCELERATE_FULL = "pytorch_model_fsdp.bin"
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
_WRAPPERS = re.compile(r"(?<![^.])(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")


def detect(path: str | Path) -> tuple[Kind, Path] | None:
    """(kind, file or directory to read) when ``path`` is an FSDP1 checkpoint (or an
    Accelerate output directory holding one), else None (e.g. HF safetensors)."""
    path = Path(path)
    if path.is_file() and path.suffix in TORCH_SUFFIXES:
        return "torch", path
    if not path.is_dir() or any(path.glob("*.safetensors")):  # HF weights: not ours
        return None
    if (path / ".metadata").is_file():
        return "dcp", path
    if (path / ACCELERATE_SHARDED / ".metadata").is_file():
        return "dcp", path / ACCELERATE_SHARDED
    if (path / ACCELERATE_FULL).is_file():
        return "torch", path / ACCELERATE_FULL
    return None


def clean_key(key: str) -> str:
    """A checkpoint key without wrapper module names (and a leading DDP ``module.``)."""
    key = _WRAPPERS.sub("", key)
    return key.removeprefix("module.")


def _prefix(model_keys: list[str], ckpt_keys: list[str]) -> str:
    """The prefix the checkpoint nests the model's names under ("" or "model." ...)."""
    votes: Counter[str] = Counter()
    by_suffix = set(ckpt_keys)
    for mk in model_keys:
        for ck in by_suffix:
            if ck.endswith(mk) and (len(ck) == len(mk) or ck[-len(mk) - 1] == "."):
                votes[ck[: len(ck) - len(mk)]] += 1
    if not votes:
        return ""
    best = max(votes.values())
    return min((p for p, n in votes.items() if n == best), key=len)


def match_keys(
    *,
    model_shapes: dict[str, tuple[int, ...]],
    ckpt_shapes: dict[str, tuple[int, ...]],
    optional: set[str],
    path: Path,
) -> tuple[dict[str, str], dict[str, str]]:
    """({model key: checkpoint key}, {optional key found: checkpoint key}); raises
    CheckpointError listing what does not map."""
    cleaned: dict[str, str] = {}
    for raw in ckpt_shapes:
        cleaned.setdefault(clean_key(raw), raw)
    prefix = _prefix(list(model_shapes), list(cleaned))
    under = {k[len(prefix) :]: raw for k, raw in cleaned.items() if k.startswith(prefix)}
    mapping = {mk: under[mk] for mk in model_shapes if mk in under}
    missing = [mk for mk in model_shapes if mk not in under and mk not in optional]
    unexpected = [k for k in under if k not in model_shapes and k not in optional]
    shapes = [
        f"{mk} (checkpoint {tuple(ckpt_shapes[ck])} vs model {tuple(model_shapes[mk])})"
        for mk, ck in mapping.items()
        if tuple(ckpt_shapes[ck]) != tuple(model_shapes[mk])
    ]
    if missing or unexpected or shapes:
        raise CheckpointError(_mismatch_message(path, prefix, missing, unexpected, shapes))
    return mapping, {alias: under[alias] for alias in optional if alias in under}


def _listed(what: str, keys: list[str]) -> str:
    shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    return f"{len(keys)} {what}: {shown}"


def _mismatch_message(
    path: Path, prefix: str, missing: list[str], unexpected: list[str], shapes: list[str]
) -> str:
    parts = []
    if missing:
        parts.append(_listed("weights the model needs are missing", missing))
    if unexpected:
        parts.append(_listed("checkpoint weights the model does not have", unexpected))
    if shapes:
        parts.append(_listed("shapes differ", shapes))
    where = f" (model keys read under the prefix {prefix!r})" if prefix else ""
    return (
        f"model.init_from = {str(path)!r} is an FSDP1 checkpoint that does not match this "
        f"model{where}: {'; '.join(parts)}. Set [model] (preset and overrides, or factory) "
        "to the architecture that was saved."
    )


def _model_state(model: nn.Module) -> tuple[dict[str, Any], dict[str, str]]:
    """(the model's state dict: DTensors when sharded, its tied aliases)."""
    return get_model_state_dict(model), tied_aliases(model)


def _load_dcp(model: nn.Module, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sd, aliases = _model_state(model)
    with dcp_errors_as(lambda cause: f"reading the DCP metadata of {path} failed: {cause}"):
        metadata = RestrictedReader(str(path)).read_metadata()
    ckpt_shapes = {
        k: tuple(md.size)
        for k, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    wanted = {k: v for k, v in sd.items() if k not in aliases}
    mapping, found = match_keys(
        model_shapes={k: tuple(v.shape) for k, v in wanted.items()},
        ckpt_shapes=ckpt_shapes,
        optional=set(aliases),
        path=path,
    )
    request = {ck: wanted[mk] for mk, ck in mapping.items()}
    copies = {alias: torch.empty_like(wanted[aliases[alias]]) for alias in found}
    request.update({found[alias]: t for alias, t in copies.items()})
    with dcp_errors_as(
        lambda cause: (
            f"reading the FSDP1 checkpoint {path} failed: {cause}. Check that it "
            "is complete (every __*.distcp file the .metadata lists)."
        )
    ):
        dcp.load(request, storage_reader=RestrictedReader(str(path)), planner=SafeLoadPlanner())
    _check_tied(path, {alias: (copies[alias], sd[aliases[alias]]) for alias in copies})
    for alias, name in aliases.items():
        sd[alias] = sd[name]
    set_model_state_dict(model, sd)


def _check_tied(path: Path, pairs: dict[str, tuple[Any, Any]]) -> None:
    """A tied alias the checkpoint holds must equal its parameter: the model cannot
    represent two different matrices there (collective for DTensors)."""
    for alias, (stored, tied) in pairs.items():
        diff = (stored - tied).abs().max()
        if hasattr(diff, "full_tensor"):
            diff = diff.full_tensor()
        if float(diff) > 0:
            raise CheckpointError(
                f"model.init_from = {str(path)!r}: {alias} differs from the parameter this "
                f"model ties it to (max difference {float(diff):.3g}); the saved model had "
                "untied weights. Set model.tie_embeddings = false (or use a model that does "
                "not tie them)."
            )


def _flatten(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested dicts of tensors (``{"model": {...}}``) as dotted keys; non-tensors skipped."""
    out: dict[str, torch.Tensor] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
    return out


def _read_torch(path: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"model.init_from = {str(path)!r} cannot be read as a weights-only torch file "
            f"({first}). fsdpkit never unpickles code from checkpoints: re-save it with "
            "torch.save(model.state_dict(), path) (tensors only)."
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"model.init_from = {str(path)!r} holds a {type(obj).__name__}, not a state dict."
        )
    return _flatten(obj)


def _load_torch(model: nn.Module, path: Path) -> None:
    sd, aliases = _model_state(model)
    full = _read_torch(path)
    wanted = {k: v for k, v in sd.items() if k not in aliases}
    mapping, found = match_keys(
        model_shapes={k: tuple(v.shape) for k, v in wanted.items()},
        ckpt_shapes={k: tuple(v.shape) for k, v in full.items()},
        optional=set(aliases),
        path=path,
    )
    state: dict[str, Any] = {mk: full[ck] for mk, ck in mapping.items()}
    _check_tied(path, {a: (full[ck], state[aliases[a]]) for a, ck in found.items()})
    for alias, name in aliases.items():
        state[alias] = state[name]
    # Every rank holds the (memory-mapped) file; each keeps only its own slice.
    set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True))


def load_fsdp1_checkpoint(model: nn.Module, path: str | Path) -> Kind:
    """Fill an already-sharded (or plain) model from an FSDP1 checkpoint; collective
    when distributed (every rank must call it). Returns the kind that was read."""
    found = detect(path)
    if found is None:
        raise CheckpointError(
            f"model.init_from = {str(path)!r} is not an FSDP1 checkpoint: expected a DCP "
            "directory (SHARDED_STATE_DICT, with .metadata), a torch file "
            f"({', '.join(TORCH_SUFFIXES)}; FULL_STATE_DICT) or an Accelerate output "
            "directory holding either."
        )
    kind, target = found
    if kind == "dcp":
        _load_dcp(model, target)
    else:
        _load_torch(model, target)
    return kind
