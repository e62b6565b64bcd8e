"""Which blocks recompute their activations in backward (``[activations]``).

``shard()`` checkpoints them before sharding (fsdpkit.sharding.units); the planner
asks the same function which blocks are recomputed.
"""

from __future__ import annotations

from torch import nn

from fsdpkit.config import ActivationsConfig


def is_checkpointed(index: int, cfg: ActivationsConfig) -> bool:
    """Whether block ``index`` (0-based, forward order) is recomputed in backward:
    none, every block, or every k-th (the k-th, 2k-th, ... blocks). The planner asks
    the same question of the same function."""
    if cfg.mode == "full":
        return True
    return cfg.mode == "every" and index % cfg.every == cfg.every - 1


def checkpointed_blocks(blocks: list[nn.Module], cfg: ActivationsConfig) -> list[nn.Module]:
    """The blocks the policy recomputes in backward."""
    return [b for i, b in enumerate(blocks) if is_checkpointed(i, cfg)]
