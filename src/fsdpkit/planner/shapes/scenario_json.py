"""A scenario as ``fsdpkit plan --json`` writes it: its plain fields, with the degrees
of its ``ParallelDims`` under the keys and at the places scripts have read them since
Scenario copied them into fields of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdpkit.config.dims import ParallelDims
from fsdpkit.planner.shapes.scenario import Scenario

_DEGREES_BEFORE = {
    "strategy": ("world_size", "replicate", "shard"),
    "cp_attention": ("tp", "cp"),
    "expert_units": ("pp", "ep"),
}
"""Where ``--json`` writes the scenario's degrees: before these fields, where they
stood when Scenario copied them (scripts read the keys; the order keeps the output the
same byte for byte)."""


def _degrees(d: ParallelDims) -> dict[str, int]:
    """The degrees as ``--json`` names them: "shard" is the ranks one parameter is
    sharded over (``fsdp_shard``: shard x cp)."""
    return dict(world_size=d.world, replicate=d.replicate, shard=d.fsdp_shard, tp=d.tp,
                cp=d.cp, pp=d.pp, ep=d.ep)  # fmt: skip


def scenario_dict(sc: Scenario) -> dict[str, Any]:
    """The scenario's plain fields for ``--json``, the degrees of ``sc.dims`` among them
    (GRPO's terms are written under "grpo" by the plan's own writer)."""
    degrees, plain = _degrees(sc.dims), dataclasses.asdict(sc)
    out: dict[str, Any] = {}
    skip = ("dims", "model", "device", "layout", "root", "units", "edges", "expert_units", "grpo")
    for name, value in plain.items():
        out |= {k: degrees[k] for k in _DEGREES_BEFORE.get(name, ())}
        if name not in skip:
            out[name] = value
    return out
