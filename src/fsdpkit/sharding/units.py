"""The FSDP units of a model with ``n`` blocks: decided once, for ``shard()`` and the planner.

Which consecutive blocks form each unit (``parallel.blocks_per_unit``), whether an
untied embedding and head get units of their own ([Note: edge units] in
fsdpkit.sharding.edges), how each unit
reshards after forward (the strategy's rule, [Note: unit resharding] below), and which
blocks recompute their activations in backward. ``shard()`` applies exactly these
specs; the planner replays them; a test checks that what FSDP2 and the checkpoint
wrapper hold on a real model equals the specs.

[Note: unit resharding]
The root unit, the head and norm units and the last block unit are needed again at
once by backward, so they stay unsharded after forward (as torchtitan does for the last block
and FSDP2 by default for a root; the head always, since the chunked loss reads its
gathered weight after the head's forward); other units, the embedding's included,
follow the strategy (``fsdpkit.sharding.policy.unit_reshard_after_forward``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fsdpkit.config import ActivationsConfig, ParallelConfig
from fsdpkit.sharding.activations import is_checkpointed
from fsdpkit.sharding.edges import EDGE_ROLES
from fsdpkit.sharding.policy import reshard_after_forward, unit_reshard_after_forward

Role = Literal["block", "embedding", "norm", "head", "root"]


@dataclass(frozen=True)
class UnitSpec:
    """One FSDP unit as ``shard()`` builds it."""

    index: int | None
    """Position among the block units in forward order; None for the other units."""
    blocks: tuple[int, ...]
    """Indices of the blocks it holds (empty for the others)."""
    reshard_after_forward: bool | int
    """What is passed to ``fully_shard`` for this unit."""
    checkpointed: tuple[bool, ...]
    """Per block of the unit: recomputed in backward."""
    role: Role = "block"
    """What the unit holds: blocks, an edge module ([Note: edge units]) or the rest."""

    @property
    def is_root(self) -> bool:
        return self.role == "root"


def block_specs(specs: Sequence[UnitSpec]) -> list[UnitSpec]:
    """The block units of ``specs``, in forward order."""
    return [s for s in specs if s.role == "block"]


def unit_specs(
    n_blocks: int,
    *,
    parallel: ParallelConfig,
    activations: ActivationsConfig,
    edges: Sequence[str] = (),
) -> tuple[UnitSpec, ...]:
    """The units in forward order (the embedding unit, the block units, the final norm's
    and the head unit: the edge units named in ``edges``, see fsdpkit.sharding.edges),
    then the root."""
    per = parallel.blocks_per_unit
    groups = [tuple(range(i, min(i + per, n_blocks))) for i in range(0, n_blocks, per)]
    raf = reshard_after_forward(parallel)
    specs = [
        UnitSpec(
            index=i,
            blocks=group,
            reshard_after_forward=unit_reshard_after_forward(raf, index=i, n_units=len(groups)),
            checkpointed=tuple(is_checkpointed(b, activations) for b in group),
        )
        for i, group in enumerate(groups)
    ]
    root_raf = unit_reshard_after_forward(raf, index=None, n_units=len(groups))

    def edge(role: Role, reshard: bool | int) -> tuple[UnitSpec, ...]:
        if role not in edges:
            return ()
        return (UnitSpec(None, (), reshard_after_forward=reshard, checkpointed=(), role=role),)

    unknown = set(edges) - set(EDGE_ROLES)
    assert not unknown, f"not edge roles: {unknown}"
    return (
        *edge("embedding", raf),
        *specs,
        *edge("norm", False),
        *edge("head", False),
        UnitSpec(None, (), reshard_after_forward=root_raf, checkpointed=(), role="root"),
    )
