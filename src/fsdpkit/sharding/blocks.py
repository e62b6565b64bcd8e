"""Which modules become FSDP units: automatic detection of repeated blocks.

A block class is a module class with at least two instances that together hold at
least half of the model's parameters; among those, the one with the fewest instances
wins (the coarsest repeated unit: a transformer layer rather than its Linear layers).
Containers (ModuleList, Sequential, ModuleDict) are never blocks. Blocks sharing a
parameter with anything outside themselves (tied weights) are left to an enclosing
unit, so a tied pair always lives in one FSDP unit.
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from fsdpkit.errors import UserError

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class BlockDetectionError(UserError, ValueError):
    """No block class could be chosen, or a named class does not exist."""


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _class_stats(model: nn.Module) -> dict[str, list[nn.Module]]:
    by_class: dict[str, list[nn.Module]] = defaultdict(list)
    for name, module in model.named_modules():
        if name and not isinstance(module, _CONTAINERS):
            by_class[type(module).__name__].append(module)
    return by_class


def _auto_class(model: nn.Module, by_class: dict[str, list[nn.Module]]) -> str | None:
    total = _numel(model)
    candidates = []
    for cls, modules in by_class.items():
        held = sum(_numel(m) for m in modules)
        if len(modules) >= 2 and total and held >= total / 2:
            candidates.append((len(modules), -held, cls))
    return min(candidates)[2] if candidates else None


def _shares_params_outside(block: nn.Module, model: nn.Module) -> bool:
    inside = {id(p) for p in block.parameters()}
    owners: dict[int, int] = defaultdict(int)
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] += 1
    local: dict[int, int] = defaultdict(int)
    for _, p in block.named_parameters(remove_duplicate=False):
        local[id(p)] += 1
    return any(owners[i] > local[i] for i in inside)


def detect_blocks(model: nn.Module, *, class_names: list[str] | None = None) -> list[nn.Module]:
    """The blocks of ``model`` in registration (usually forward) order.

    ``class_names`` overrides the automatic choice; unknown names are an error that
    lists the classes the model has.
    """
    by_class = _class_stats(model)
    if class_names:
        unknown = [c for c in class_names if c not in by_class]
        if unknown:
            raise BlockDetectionError(
                f"parallel.block_classes: {unknown} not found in the model. Its module "
                f"classes are: {', '.join(sorted(by_class))}. Name one of those, or leave "
                "parallel.block_classes empty to detect blocks automatically."
            )
        chosen = set(class_names)
    else:
        auto = _auto_class(model, by_class)
        chosen = {auto} if auto else set()
    blocks = [m for n, m in model.named_modules() if n and type(m).__name__ in chosen]
    # Outermost only: a block nested inside another chosen block is covered by it.
    nested = {id(sub) for b in blocks for sub in b.modules() if sub is not b}
    return [b for b in blocks if id(b) not in nested and not _shares_params_outside(b, model)]
