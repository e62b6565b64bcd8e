"""Which modules become FSDP units: the model's repeated trunk, found automatically.

[Note: block detection]
A block is an instance of the coarsest repeated module that forms the model's trunk:

1. A class named by ``parallel.block_classes`` (the user's override), else
2. the classes the model declares unsplittable (Hugging Face's ``_no_split_modules``),
   where the model has them, else
3. the trunk: module classes with at least two instances held directly by one
   container (``ModuleList`` / ``Sequential`` / ``ModuleDict``, e.g. a transformer's
   ``layers``), else any class with at least two instances; in both cases only
   classes whose instances are never nested inside another candidate's instances
   (the coarsest), and of those the one holding the most parameters.

Parameter count alone is not the rule: a small model with a large vocabulary keeps
most of its parameters in the embedding and head, and "the class with the most
parameters" would then be ``nn.Linear`` (every projection its own unit). Containers
are never blocks. Blocks sharing a parameter with anything outside themselves (tied
weights) are left to an enclosing unit, so a tied pair always lives in one FSDP unit.
The choice comes with a one-sentence reason for the logs and the planner.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from fsdpkit.errors import UserError

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class BlockDetectionError(UserError, ValueError):
    """No block class could be chosen, or a named class does not exist."""


@dataclass(frozen=True)
class BlockChoice:
    """The blocks ``shard()`` makes units of, and why."""

    blocks: tuple[nn.Module, ...]
    """In registration (usually forward) order."""
    class_name: str | None
    """Class of the blocks (None when the model has no repeated blocks)."""
    reason: str
    """How the class was chosen and what share of parameters it holds."""

    def describe(self) -> str:
        if not self.blocks:
            return self.reason
        return f"{len(self.blocks)} x {self.class_name}: {self.reason}"


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _by_class(model: nn.Module) -> dict[str, list[nn.Module]]:
    out: dict[str, list[nn.Module]] = defaultdict(list)
    for name, module in model.named_modules():
        if name and not isinstance(module, _CONTAINERS):
            out[type(module).__name__].append(module)
    return out


def _trunk_classes(model: nn.Module) -> dict[str, list[nn.Module]]:
    """Classes with >= 2 instances held directly by one container, with those instances."""
    out: dict[str, list[nn.Module]] = defaultdict(list)
    for container in model.modules():
        if not isinstance(container, _CONTAINERS):
            continue
        groups: dict[str, list[nn.Module]] = defaultdict(list)
        for child in container.children():
            if not isinstance(child, _CONTAINERS) and _numel(child):
                groups[type(child).__name__].append(child)
        for cls, members in groups.items():
            if len(members) >= 2:
                out[cls].extend(members)
    return out


def _coarsest(candidates: dict[str, list[nn.Module]]) -> str | None:
    """Among candidate classes whose instances sit inside no other candidate's
    instance, the one holding the most parameters."""
    inside: set[int] = set()
    for members in candidates.values():
        for m in members:
            inside.update(id(sub) for sub in m.modules() if sub is not m)
    outer = {
        cls: members
        for cls, members in candidates.items()
        if not any(id(m) in inside for m in members)
    }
    if not outer:
        return None
    return max(outer, key=lambda cls: (sum(_numel(m) for m in outer[cls]), -len(outer[cls])))


def _declared(model: nn.Module, by_class: dict[str, list[nn.Module]]) -> list[str]:
    declared = getattr(model, "_no_split_modules", None) or []
    return [c for c in declared if c in by_class]


def _auto(model: nn.Module, by_class: dict[str, list[nn.Module]]) -> tuple[set[str], str]:
    declared = _declared(model, by_class)
    if declared:
        return set(declared), "declared by the model (_no_split_modules)"
    cls = _coarsest(_trunk_classes(model))
    if cls is not None:
        return {cls}, "the model's repeated trunk (instances held by one container)"
    repeated = {c: ms for c, ms in by_class.items() if len(ms) >= 2 and any(map(_numel, ms))}
    cls = _coarsest(repeated)
    if cls is not None:
        return {cls}, "the outermost repeated module class"
    return set(), "the model has no repeated module: it is one unit"


def _shares_params_outside(block: nn.Module, owners: dict[int, int]) -> bool:
    local: dict[int, int] = defaultdict(int)
    for _, p in block.named_parameters(remove_duplicate=False):
        local[id(p)] += 1
    return any(owners[i] > n for i, n in local.items())


def _explicit(class_names: Sequence[str], by_class: dict[str, list[nn.Module]]) -> set[str]:
    unknown = [c for c in class_names if c not in by_class]
    if unknown:
        raise BlockDetectionError(
            f"parallel.block_classes: {unknown} not found in the model. Its module "
            f"classes are: {', '.join(sorted(by_class))}. Name one of those, or leave "
            "parallel.block_classes empty to detect blocks automatically."
        )
    return set(class_names)


def choose_blocks(model: nn.Module, *, class_names: Sequence[str] | None = None) -> BlockChoice:
    """The blocks of ``model`` and the reason (see [Note: block detection]);
    ``class_names`` overrides the automatic choice (unknown names are an error that
    lists the classes the model has)."""
    by_class = _by_class(model)
    if class_names:
        chosen, how = _explicit(class_names, by_class), "set by parallel.block_classes"
    else:
        chosen, how = _auto(model, by_class)
    blocks = [m for n, m in model.named_modules() if n and type(m).__name__ in chosen]
    # Outermost only: a block nested inside another chosen block is covered by it.
    nested = {id(sub) for b in blocks for sub in b.modules() if sub is not b}
    owners: dict[int, int] = defaultdict(int)
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] += 1
    outer = [b for b in blocks if id(b) not in nested]
    kept = tuple(b for b in outer if not _shares_params_outside(b, owners))
    return BlockChoice(
        kept, _class_label(kept), _reason(model, kept, how, tied=len(outer) - len(kept))
    )


def _class_label(blocks: Sequence[nn.Module]) -> str | None:
    names = sorted({type(b).__name__ for b in blocks})
    return "/".join(names) if names else None


def _reason(model: nn.Module, blocks: Sequence[nn.Module], how: str, *, tied: int) -> str:
    if not blocks:
        return how if "no repeated" in how else f"{how}, but no block can be its own unit"
    total = _numel(model) or 1
    share = sum(_numel(b) for b in blocks) / total
    text = f"{how}; {share:.0%} of the parameters"
    if tied:
        text += f" ({tied} left to the enclosing unit: they share a tied parameter)"
    return text


def detect_blocks(model: nn.Module, *, class_names: Sequence[str] | None = None) -> list[nn.Module]:
    """The blocks of ``model`` in registration order (see ``choose_blocks``)."""
    return list(choose_blocks(model, class_names=class_names).blocks)
