"""transformers' own weight conversions, applied to a model's sharded parameters.

[Note: one loading rule with transformers]
A Hugging Face directory does not always hold tensors under the names the model's
modules have in memory. transformers 5 keeps mixture-of-experts checkpoints in their
original per-expert layout (Mixtral: ``model.layers.0.block_sparse_moe.experts.3.w1.weight``)
and fuses them while loading (``mlp.experts.gate_up_proj``, one ``[experts, 2 x ffn,
dim]`` tensor), renames legacy names, and splits or merges projections; the rules are
its ``WeightRenaming`` / ``WeightConverter`` lists (``get_model_conversion_mapping``),
and ``save_pretrained`` applies them in reverse. A reader that matches names finds the
fused names "missing" although every byte is in the directory.

fsdpkit maps keys exactly as ``from_pretrained`` does, with transformers' own
functions (``rename_source_key``, each converter's ``convert``), never a table per
family:

- ``plan_keys`` sorts the directory's keys as transformers does and sends each one
  through the renamings and at most one converter. A key that ends under a model name
  is either a plain rename (read by DCP, each rank only its own slices) or a source of
  a converter group; the groups are run once on meta tensors to learn the names and
  shapes they produce, so missing weights and shape mismatches are known before any
  byte is read.
- ``read_group`` runs one group on real tensors. Experts stacked along dim 0
  (``MergeModulelist(dim=0)`` first) under FSDP's dim-0 sharding are read only for the
  experts this rank holds (transformers' ``DtensorShardOperation``); any other group
  is read whole, one group at a time, converted, and each rank keeps its slice.
- ``to_checkpoint_layout`` is the reverse for exports (``revert_weight_conversion``,
  what ``save_pretrained`` calls), and ``export_groups`` says which model tensors a
  reverse conversion needs together, so an export shard never splits one.
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdpkit.pretrained import is_hf_model


@dataclass
class Group:
    """Checkpoint tensors that become model tensors through one transformers converter."""

    first: str
    """The first model key the group produces (the name transformers converts under)."""
    converter: Any
    """The group's own copy of the ``WeightConverter``."""
    sources: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    """Source pattern -> checkpoint keys, in transformers' load order."""
    targets: dict[str, torch.Size] = field(default_factory=dict)
    """Model key -> the shape the conversion produces (from the meta dry run)."""


@dataclass
class KeyPlan:
    """Where each model tensor comes from in a directory."""

    renamed: dict[str, str]
    """Model key -> checkpoint key, one to one (DCP reads these)."""
    groups: list[Group]
    unexpected: list[str]
    """Checkpoint keys with no place in the model (and not ignored by the model)."""
    absent: list[str] = field(default_factory=list)
    """Checkpoint keys a converter group needs but the directory lacks (its targets
    are then missing)."""

    def produced(self) -> set[str]:
        """Every model key the directory provides."""
        return set(self.renamed) | {k for g in self.groups for k in g.targets}

    def converted(self) -> bool:
        """Whether any key is renamed or converted (the directory is not in the model's
        own names)."""
        return bool(self.groups) or any(k != v for k, v in self.renamed.items())


def _transformers_loading() -> Any:
    from transformers import core_model_loading

    return core_model_loading


def conversions(shadow: nn.Module) -> list[Any]:
    """The transforms ``from_pretrained`` applies to ``shadow`` (a transformers model,
    not sharded: FSDP renames its class), legacy renames included; [] for other models."""
    if not is_hf_model(shadow):
        return []
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(shadow))


def _ignored(shadow: nn.Module, key: str) -> bool:
    patterns = getattr(shadow, "_keys_to_ignore_on_load_unexpected", None) or ()
    return any(re.search(p, key) for p in patterns)


def plan_keys(shadow: nn.Module, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> KeyPlan:
    """Map a directory's tensors (``shapes``: checkpoint key -> size, dtype) onto
    ``shadow``'s state-dict keys as ``from_pretrained`` does ([Note: one loading rule
    with transformers])."""
    core = _transformers_loading()
    transforms = conversions(shadow)
    renamings = [t for t in transforms if isinstance(t, core.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, core.WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    model_keys = shadow.state_dict(keep_vars=True)
    prefix = getattr(shadow, "base_model_prefix", None) or None
    renamed: dict[str, str] = {}
    groups: dict[str, Group] = {}
    unexpected = []
    for key in sorted(shapes, key=core.dot_natural_key):
        target, pattern = core.rename_source_key(key, renamings, converters, prefix, model_keys)
        if target not in model_keys and key in model_keys:
            target, pattern = core.rename_source_key(key, [], [], prefix, model_keys)
        if target not in model_keys:
            if not _ignored(shadow, key):
                unexpected.append(key)
        elif pattern is None:
            renamed[target] = key
        else:
            group = groups.setdefault(target, Group(target, copy.deepcopy(by_pattern[pattern])))
            group.sources[pattern].append(key)
    absent: list[str] = []
    for group in groups.values():
        lacks = _absent_pieces(group)
        absent += lacks
        if not lacks:
            group.targets = {
                k: v.shape for k, v in _convert(shadow, group, shapes, meta=True).items()
            }
    return KeyPlan(
        renamed=renamed,
        groups=[g for g in groups.values() if g.targets],
        unexpected=unexpected,
        absent=absent,
    )


def _absent_pieces(group: Group) -> list[str]:
    """Checkpoint keys a group of numbered pieces (one tensor per expert) lacks: every
    pattern must hold every number any of them holds. Names a removed expert tensor
    instead of failing inside the conversion."""
    numbered: dict[str, dict[int, str]] = {}
    for pattern, keys in group.sources.items():
        parts = [k.split(".") for k in keys]
        varying = [i for i in range(len(parts[0])) if len({p[i] for p in parts if len(p) > i}) > 1]
        if len(keys) < 2 or not varying or not all(p[varying[0]].isdigit() for p in parts):
            continue
        numbered[pattern] = {int(p[varying[0]]): k for p, k in zip(parts, keys)}
        numbered[pattern][-1] = str(varying[0])  # where the number sits
    if not numbered:
        return []
    every = {n for found in numbered.values() for n in found if n >= 0}
    every = set(range(max(every) + 1))
    absent = []
    for found in numbered.values():
        at = int(found.pop(-1))
        template = next(iter(found.values())).split(".")
        for n in sorted(every - set(found)):
            absent.append(".".join([*template[:at], str(n), *template[at + 1 :]]))
    return absent


def _convert(
    shadow: nn.Module,
    group: Group,
    tensors: dict[str, Any],
    *,
    meta: bool = False,
) -> dict[str, torch.Tensor]:
    """Run the group's converter on ``tensors`` (checkpoint key -> tensor; with
    ``meta``, key -> (size, dtype) and the run is on meta tensors)."""
    converter = copy.deepcopy(group.converter)
    for pattern, keys in group.sources.items():
        values = []
        for key in keys:
            value = tensors[key]
            if meta:
                value = torch.empty(value[0], dtype=value[1], device="meta")
            if value is not None:
                values.append(value)
        converter.collected_tensors[pattern] = values
    out = converter.convert(group.first, model=shadow, config=getattr(shadow, "config", None))
    return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}


def _experts_on_read(group: Group, param: torch.Tensor) -> Any | None:
    """transformers' shard-on-read for a group that stacks per-expert tensors along
    dim 0 into one parameter split only along dim 0 (FSDP); None: read whole.
    DTensor is imported here, not at the top: the planner reaches this module through
    the models layer, and DTensor's import (~0.5 s) is most of a plan's start-up."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    core = _transformers_loading()
    ops = getattr(group.converter, "operations", [])
    if not ops or not isinstance(ops[0], core.MergeModulelist) or ops[0].dim != 0:
        return None
    if len(group.targets) != 1 or not isinstance(param, DTensor):
        return None
    if any(
        not isinstance(p, Replicate | Shard) or (isinstance(p, Shard) and p.dim != 0)
        for p in param.placements
    ):
        return None
    from transformers.distributed.sharding_utils import DtensorShardOperation

    return DtensorShardOperation(param)


def read_group(
    shadow: nn.Module,
    group: Group,
    *,
    open_slice: Any,
    params: dict[str, torch.Tensor],
) -> None:
    """Fill ``params`` (model key -> this rank's parameter, plain or DTensor) with the
    group's converted values. ``open_slice(key)`` gives a lazily read safetensors
    slice of a checkpoint key."""
    from fsdpkit.init import copy_full_value

    (only,) = group.targets if len(group.targets) == 1 else (None,)
    on_read = _experts_on_read(group, params[only]) if only else None
    tensors: dict[str, Any] = {}
    for keys in group.sources.values():
        for index, key in enumerate(keys):
            piece = open_slice(key)
            if on_read is None:
                tensors[key] = piece[...]
            else:
                tensors[key] = on_read.shard_tensor(piece, tensor_idx=index)
    if on_read is not None and only is not None:
        local = params[only].to_local()  # type: ignore[attr-defined]  # a DTensor shard
        if local.numel() == 0:
            return
        value = _convert(shadow, group, tensors)[only]
        with torch.no_grad():
            local.copy_(value.to(local.dtype))
        return
    for name, value in _convert(shadow, group, tensors).items():
        copy_full_value(params[name], value.to(params[name].dtype))


def export_groups(shadow: nn.Module, names: list[str]) -> list[list[str]]:
    """``names`` (model keys) in the sets a reverse conversion needs together: each
    converter target of ``shadow``'s transforms with the targets it shares a
    converter with; every other name alone. Order follows ``names``."""
    core = _transformers_loading()
    reverse = [t.reverse_transform() for t in conversions(shadow)[::-1]]
    converters = [t for t in reverse if isinstance(t, core.WeightConverter)]
    together: dict[str, list[str]] = {}
    out: list[list[str]] = []
    for name in names:
        renamed, pattern = core.apply_converters(name, converters)
        if pattern is None:
            out.append([name])
            continue
        if renamed not in together:  # revert_weight_conversion groups by this name
            together[renamed] = []
            out.append(together[renamed])
        together[renamed].append(name)
    return out


def to_checkpoint_layout(
    shadow: nn.Module, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``tensors`` (model keys) in the layout ``save_pretrained`` writes for
    ``shadow`` (transformers' ``revert_weight_conversion``); unchanged for models
    transformers converts nothing for."""
    if not is_hf_model(shadow) or not tensors:
        return tensors
    core = _transformers_loading()
    return dict(core.revert_weight_conversion(shadow, dict(tensors)))
