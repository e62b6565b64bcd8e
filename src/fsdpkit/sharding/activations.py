"""Activation checkpointing of whole blocks, applied before sharding."""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint

from fsdpkit.config import ActivationsConfig


def checkpointed_blocks(blocks: list[nn.Module], cfg: ActivationsConfig) -> list[nn.Module]:
    """The blocks the policy recomputes in backward: none, all, or every k-th."""
    if cfg.mode == "none":
        return []
    if cfg.mode == "full":
        return list(blocks)
    return [b for i, b in enumerate(blocks) if i % cfg.every == cfg.every - 1]


def apply_activation_checkpointing(blocks: list[nn.Module], cfg: ActivationsConfig) -> int:
    """Checkpoint the chosen blocks in place (composable API: module names and
    state-dict keys are unchanged). Returns how many blocks are checkpointed."""
    chosen = checkpointed_blocks(blocks, cfg)
    for block in chosen:
        checkpoint(block)
    return len(chosen)
