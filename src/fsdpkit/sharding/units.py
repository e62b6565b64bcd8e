"""The FSDP units of a model with ``n`` blocks: decided once, for ``shard()`` and the planner.

Which consecutive blocks form each unit (``parallel.blocks_per_unit``), how each unit
reshards after forward (the strategy's rule, [Note: unit resharding] below), and which
blocks recompute their activations in backward. ``shard()`` applies exactly these
specs; the planner replays them; a test checks that what FSDP2 and the checkpoint
wrapper hold on a real model equals the specs.

[Note: unit resharding]
The root unit (embedding, head) and the last block unit are needed again at once by
backward, so with resharding on they stay unsharded after forward (as torchtitan
does for the last block and FSDP2 by default for a root); other units follow the
strategy (``fsdpkit.sharding.policy.unit_reshard_after_forward``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpkit.config import ActivationsConfig, ParallelConfig
from fsdpkit.sharding.activations import is_checkpointed
from fsdpkit.sharding.policy import reshard_after_forward, unit_reshard_after_forward


@dataclass(frozen=True)
class UnitSpec:
    """One FSDP unit as ``shard()`` builds it."""

    index: int | None
    """Position among the block units in forward order; None for the root unit."""
    blocks: tuple[int, ...]
    """Indices of the blocks it holds (empty for the root)."""
    reshard_after_forward: bool | int
    """What is passed to ``fully_shard`` for this unit."""
    checkpointed: tuple[bool, ...]
    """Per block of the unit: recomputed in backward."""

    @property
    def is_root(self) -> bool:
        return self.index is None


def unit_specs(
    n_blocks: int, *, parallel: ParallelConfig, activations: ActivationsConfig
) -> tuple[UnitSpec, ...]:
    """The block units in forward order, then the root unit."""
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
    return (
        *specs,
        UnitSpec(index=None, blocks=(), reshard_after_forward=root_raf, checkpointed=()),
    )
