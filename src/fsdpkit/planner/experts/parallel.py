"""Expert parallelism in the plan: the units ``shard()`` builds under ``parallel.ep``,
the dispatch's traffic, and the bound a real step's routing can reach.

[Note: expert units]
Under ep (fsdpkit.sharding.experts.parallel) a block's routed experts are an FSDP unit of their
own, sharded over the efsdp ranks (shard / ep, cp folded in) with E / ep experts per
rank: each rank stores (E / ep) / efsdp = E / shard of them, as FSDP alone stores, but
all-gathers and reduce-scatters only its ep rank's E / ep experts, over efsdp ranks.
The block unit keeps the rest (attention, router, norms, shared experts). ``ep_units``
splits the planner's units the same way, so model states, the all-gather buffers of a
unit and the traffic follow; the trace ([Note: traced planning]) runs the real split.

The dispatch sends each micro-batch's tokens x top_k rows of width d, all but the
1 / ep kept on the rank, to the ep ranks and back (two all-to-alls), in forward,
backward and a checkpointed block's recompute: ``dispatch_bytes``. These exchanges sit
on the critical path (each waits for the router), like tp / cp's.
"""

from __future__ import annotations

from dataclasses import replace

from fsdpkit.config import ActivationsConfig, ParallelConfig
from fsdpkit.planner.model.unit_layout import ModelLayout, Unit, Units, make_unit, units
from fsdpkit.sharding.units import block_specs, unit_specs


def _dense(layout: ModelLayout) -> ModelLayout:
    """``layout`` without the routed experts' parameters in its blocks."""
    keep = [[not r for r in routed] for routed in layout.routed]
    blocks = tuple(
        tuple(s for s, k in zip(b, ks, strict=True) if k) for b, ks in zip(layout.blocks, keep)
    )
    frozen = tuple(
        tuple(f for f, k in zip(fs, ks, strict=True) if k) for fs, ks in zip(layout.frozen, keep)
    )
    names = tuple(n for n, k in zip(layout.block_names, keep[0], strict=True) if k)
    return replace(layout, blocks=blocks, frozen=frozen, block_names=names)


def ep_units(
    layout: ModelLayout,
    *,
    shard: int,
    ep: int,
    parallel: ParallelConfig,
    activations: ActivationsConfig,
) -> tuple[Units, tuple[Unit, ...]]:
    """(the block, edge and root units without the routed experts, one experts unit per
    MoE block) for a shard group of ``shard`` ranks (cp folded in), [Note: expert
    units]; ep = 1 or a dense model: the usual units and no experts units."""
    if ep == 1 or not layout.routed:
        return units(layout, shard=shard, parallel=parallel, activations=activations), ()
    planned = units(_dense(layout), shard=shard, parallel=parallel, activations=activations)
    specs = block_specs(unit_specs(len(layout.blocks), parallel=parallel, activations=activations))
    raf = {b: s.reshard_after_forward for s in specs for b in s.blocks}
    checkpointed = {b: c for s in specs for b, c in zip(s.blocks, s.checkpointed)}
    experts = []
    for b, (shapes, routed) in enumerate(zip(layout.blocks, layout.routed, strict=True)):
        mine = [(rows // ep, cols) for (rows, cols), r in zip(shapes, routed, strict=True) if r]
        if not mine:
            continue
        experts.append(
            make_unit(
                f"layers.{b}.experts", mine, shard=shard // ep, blocks=(b,),
                raf=raf[b] if isinstance(raf[b], bool) else True,
                checkpointed=(checkpointed[b],),
            )
        )  # fmt: skip
    return planned, tuple(experts)


def hidden_size(layout: ModelLayout) -> int:
    """The model's hidden size: its input embedding's width."""
    shapes = [*layout.root, *(s for e in layout.edges for s in e.shapes)]
    return next((cols for rows, cols in shapes if rows == layout.embedding_rows), 0)


def dispatch_bytes(
    *, layers: int, tokens: int, top_k: int, dim: int, ep: int, e: int, checkpointed: int
) -> tuple[int, int]:
    """(bytes each rank sends in one micro-batch's all-to-alls, their calls), balanced
    routing ([Note: expert units]): per MoE layer two all-to-alls of ``tokens x top_k``
    rows of ``dim`` values of ``e`` bytes forward, two backward, two more in each of the
    ``checkpointed`` layers' recompute; (ep - 1) / ep of the rows leave the rank. The
    per-expert counts (E integers per all-to-all) are left out."""
    if ep == 1:
        return 0, 0
    passes = 4 * layers + 2 * checkpointed
    rows = tokens * top_k * (ep - 1) // ep
    return passes * rows * dim * e, passes + layers * (1 + (checkpointed > 0))
