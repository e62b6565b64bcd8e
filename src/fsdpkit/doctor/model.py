"""Model checks on the units ``fsdpkit.shard`` would build: what stays in the root
unit, parameters shared across units, dtypes FSDP2 cannot mix, uneven units.

They only read module structure and shapes, so they run on a meta-device model of
any size. A unit is a list of blocks (``parallel.blocks_per_unit``); everything not
in a block unit belongs to the root unit, which FSDP2 keeps unsharded from the start
of forward to the end of backward.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fsdpkit.config import RunConfig
from fsdpkit.doctor.check import Check, fail, ok, skip, warn
from fsdpkit.sharding import unit_specs
from fsdpkit.sharding.edges import edge_modules
from fsdpkit.sharding.units import block_specs

ROOT = -1
EDGE = -2
"""An untied embedding (EDGE) or head (EDGE - 1): units of their own ([Note: edge
units] in fsdpkit.sharding.edges)."""
ROOT_SHARE_WARN = 1 / 3
"""Root share of all parameters above which the root unit is called out."""
BLOCK_SPREAD_WARN = 2.0
"""Largest / smallest block unit above which units are called uneven."""
ROOT_VS_BLOCK_WARN = 4.0
"""Root unit / median block unit above which the root is called out."""


def plan_units(blocks: Sequence[nn.Module], cfg: RunConfig) -> list[list[nn.Module]]:
    """The block units ``shard`` builds (``fsdpkit.sharding.unit_specs``); edge and root
    units left out."""
    specs = unit_specs(len(blocks), parallel=cfg.parallel, activations=cfg.activations)
    return [[blocks[i] for i in spec.blocks] for spec in block_specs(specs)]


@dataclass(frozen=True)
class ParamInfo:
    """One parameter registration: its name, which unit holds it, and the tensor."""

    name: str
    unit: int
    """Index into the units, ROOT or EDGE."""
    param: nn.Parameter


def param_table(
    model: nn.Module, units: list[list[nn.Module]], *, edge_units: bool = True
) -> list[ParamInfo]:
    """Every parameter registration (tied parameters once per name) with its unit
    (``edge_units``: parallel.edge_units)."""
    unit_of: dict[int, int] = {}
    blocks = [b for unit in units for b in unit]
    edges = edge_modules(model, blocks=blocks, enabled=edge_units)
    for u, unit in [*((EDGE - i, [m]) for i, m in enumerate(edges.values())), *enumerate(units)]:
        for block in unit:
            for sub in block.modules():
                unit_of[id(sub)] = u
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        out.append(ParamInfo(name, unit_of.get(id(owner), ROOT), p))
    return out


def _fmt(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def unit_sizes(table: list[ParamInfo], n_units: int) -> tuple[list[int], int]:
    """(parameters per block unit, parameters in the root), tied ones counted once;
    edge units are neither."""
    sizes = [0] * n_units
    root = 0
    seen: set[int] = set()
    for info in table:
        if id(info.param) in seen or info.unit <= EDGE:
            continue
        seen.add(id(info.param))
        if info.unit == ROOT:
            root += info.param.numel()
        else:
            sizes[info.unit] += info.param.numel()
    return sizes, root


def check_root_share(table: list[ParamInfo], units: list[list[nn.Module]]) -> Check:
    """Parameters in no block unit: FSDP2's root unit gathers them for the whole step."""
    sizes, root = unit_sizes(table, len(units))
    edge = sum({id(i.param): i.param.numel() for i in table if i.unit <= EDGE}.values())
    total = root + sum(sizes) + edge
    name = "params outside blocks"
    if total == 0:
        return skip(name, "the model has no parameters")
    if not units:
        return warn(
            name,
            f"no block units: all {_fmt(total)} parameters are in the root unit, so every "
            "rank gathers the whole model for forward and backward (sharding then only "
            "saves gradient and optimizer memory)",
            "name the repeated block class in parallel.block_classes",
        )
    held: dict[str, int] = defaultdict(int)
    for i in table:
        if i.unit == ROOT:
            held[i.name.rsplit(".", 1)[0] if "." in i.name else "(root)"] += i.param.numel()
    outside = sorted((m for m in held if held[m]), key=lambda m: (-held[m], m))  # largest first
    share = root / total
    where = f"{_fmt(root)} of {_fmt(total)} parameters ({share:.0%}) are outside the " + (
        f"{len(units)} block units: {', '.join(outside[:6])}{' ...' if len(outside) > 6 else ''}"
    )
    if edge:
        where += f"; {_fmt(edge)} in the untied embedding and head's own units"
    if share > ROOT_SHARE_WARN:
        return warn(
            name,
            f"{where}; the root unit keeps them unsharded for the whole step",
            "add their module classes to parallel.block_classes so they get their own units",
        )
    return ok(name, where + " (root unit)")


def _block_classes(model: nn.Module, units: list[list[nn.Module]], named: list[str]) -> set[str]:
    """Classes fsdpkit wraps: the units' and the configured ones; when sharing left no
    unit at all, every repeated class with submodules (leaf layers are never blocks)."""
    chosen = {type(b).__name__ for unit in units for b in unit} | set(named)
    if chosen:
        return chosen
    counts: dict[str, int] = defaultdict(int)
    for _, m in model.named_modules():
        if any(True for _ in m.children()):
            counts[type(m).__name__] += 1
    containers = {"ModuleList", "ModuleDict", "Sequential"}
    return {c for c, n in counts.items() if n > 1 and c not in containers}


def _split_blocks(
    table: list[ParamInfo], model: nn.Module, block_classes: set[str]
) -> dict[str, list[str]]:
    """{block path: aliases outside it} for blocks that own some but not all names of
    a shared parameter (``detect_blocks`` leaves those to the enclosing unit)."""
    by_param: dict[int, list[str]] = defaultdict(list)
    for info in table:
        by_param[id(info.param)].append(info.name)
    out: dict[str, list[str]] = {}
    for names in (n for n in by_param.values() if len(n) > 1):
        for alias in names:
            parts = alias.split(".")[:-1]
            for depth in range(1, len(parts) + 1):
                path = ".".join(parts[:depth])
                outside = [n for n in names if not n.startswith(path + ".")]
                if outside and type(model.get_submodule(path)).__name__ in block_classes:
                    out.setdefault(path, outside)
    return out


def check_shared_params(
    model: nn.Module,
    table: list[ParamInfo],
    units: list[list[nn.Module]],
    *,
    block_classes: tuple[str, ...] | list[str] = (),
) -> Check:
    """A parameter registered under several names must live in one unit; blocks that
    share one with the outside are left to the root (fsdpkit.sharding.blocks)."""
    name = "shared params"
    groups: dict[int, list[ParamInfo]] = defaultdict(list)
    for info in table:
        groups[id(info.param)].append(info)
    shared = [g for g in groups.values() if len(g) > 1]
    across = [g for g in shared if len({i.unit for i in g}) > 1]
    if across:
        text = "; ".join(
            " = ".join(f"{i.name} (unit {'root' if i.unit == ROOT else i.unit})" for i in g)
            for g in across[:3]
        )
        return fail(
            name,
            f"parameters shared across FSDP units: {text}. Each unit would shard and "
            "all-gather its own copy, and gradients would be reduced twice",
            "put the modules sharing a parameter into one unit (parallel.block_classes), "
            "or untie the parameter",
        )
    split = _split_blocks(table, model, _block_classes(model, units, list(block_classes)))
    if split:
        listed = "; ".join(
            f"{p} shares with {', '.join(o[:2])}" for p, o in list(split.items())[:4]
        )
        return warn(
            name,
            f"{len(split)} repeated block(s) share parameters with modules outside them "
            f"({listed}): fsdpkit cannot make them units, so their parameters go to the "
            "enclosing (usually root) unit",
            "untie the parameters, or name a larger class that contains all users of the "
            "shared parameter in parallel.block_classes",
        )
    if shared:
        pairs = "; ".join(" = ".join(i.name for i in g) for g in shared[:3])
        return ok(name, f"{len(shared)} shared parameter(s), each within one unit: {pairs}")
    return ok(name, "no parameter is registered under two names")


def check_dtypes(model: nn.Module, table: list[ParamInfo], units: list[list[nn.Module]]) -> Check:
    """FSDP2 requires one floating dtype per unit; non-floating parameters are legal
    but are sharded and gathered like weights without ever being trained."""
    name = "dtypes"
    per_unit: dict[int, set[torch.dtype]] = defaultdict(set)
    non_float = []
    for info in table:
        if info.param.is_floating_point():
            per_unit[info.unit].add(info.param.dtype)
        else:
            non_float.append(f"{info.name} ({info.param.dtype})")
    mixed = {u: d for u, d in per_unit.items() if len(d) > 1}
    if mixed:
        u, found = next(iter(mixed.items()))
        where = "the root unit" if u == ROOT else "an edge unit" if u <= EDGE else f"unit {u}"
        return fail(
            name,
            f"{where} mixes parameter dtypes {sorted(str(d) for d in found)}: FSDP2 "
            "refuses that at the first forward ('FSDP expects uniform original parameter "
            "dtype')",
            "build every parameter in one dtype (fsdpkit's precision.mode casts for compute)",
        )
    buffers = [(n, b) for n, b in model.named_buffers() if b is not None]
    int_buffers = [n for n, b in buffers if not b.is_floating_point()]
    if non_float:
        return warn(
            name,
            f"non-floating parameters {', '.join(non_float[:4])}: sharded and all-gathered "
            "every step like weights, never trained",
            "register them as buffers (register_buffer) instead of nn.Parameter",
        )
    names = sorted({str(info.param.dtype) for info in table})
    extra = (
        f"; non-floating buffers (not sharded): {', '.join(int_buffers[:4])}" if int_buffers else ""
    )
    return ok(name, f"parameters are {', '.join(names) or 'none'}{extra}")


def check_unit_balance(table: list[ParamInfo], units: list[list[nn.Module]]) -> Check:
    """Uneven units: the largest sets the all-gather buffer and the memory peak."""
    name = "unit sizes"
    sizes, root = unit_sizes(table, len(units))
    if not units:
        return skip(name, "no block units to compare")
    nonzero = sorted(s for s in sizes if s)
    if not nonzero:
        return skip(name, "block units hold no parameters")
    median = nonzero[len(nonzero) // 2]
    spread = nonzero[-1] / nonzero[0]
    found = (
        f"{len(units)} block units of {_fmt(nonzero[0])}..{_fmt(nonzero[-1])} parameters, "
        f"root {_fmt(root)}"
    )
    if spread > BLOCK_SPREAD_WARN:
        big = max(range(len(sizes)), key=lambda i: sizes[i])
        return warn(
            name,
            f"{found}: the largest (unit {big}) is {spread:.1f}x the smallest; memory peaks "
            "while the largest is gathered",
            "group blocks evenly (parallel.blocks_per_unit) or name more even block classes",
        )
    if root > ROOT_VS_BLOCK_WARN * median:
        return warn(
            name,
            f"{found}: the root unit is {root / median:.1f}x a block unit and stays "
            "unsharded through forward and backward",
            "give the largest root modules (embeddings, output head) their own units via "
            "parallel.block_classes if memory is tight",
        )
    return ok(name, found)


def structure_checks(
    model: nn.Module,
    units: list[list[nn.Module]],
    *,
    block_classes: list[str],
    edge_units: bool = True,
) -> list[Check]:
    """The structural checks over ``units`` (as ``plan_units`` groups them; the edge
    units as ``parallel.edge_units`` makes them)."""
    table = param_table(model, units, edge_units=edge_units)
    return [
        check_root_share(table, units),
        check_shared_params(model, table, units, block_classes=block_classes),
        check_dtypes(model, table, units),
        check_unit_balance(table, units),
    ]
