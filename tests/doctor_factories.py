"""Small models with the problems ``fsdpkit doctor`` must find (``model.factory``)."""

from __future__ import annotations

import torch
from torch import nn

from support import MLPNet


def shared_across_blocks() -> nn.Module:
    """Blocks 0 and 1 share one weight: neither can be its own FSDP unit."""
    model = MLPNet(vocab=256)
    model.blocks[1].fc1.weight = model.blocks[0].fc1.weight
    return model


class Positions(nn.Module):
    """An MLP LM with a sinusoidal table kept as a non-persistent buffer."""

    def __init__(self, recreate: bool = False) -> None:
        super().__init__()
        self.net = MLPNet(vocab=256)
        self.recreate = recreate
        self.register_buffer("table", self._table(), persistent=False)

    @staticmethod
    def _table() -> torch.Tensor:
        return torch.sin(torch.arange(64, dtype=torch.float32) / 7.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens) + self.table.sum() * 0


class RecreatedPositions(Positions):
    def init_buffers(self) -> None:
        with torch.no_grad():
            self.table.copy_(self._table())


def meta_buffer() -> nn.Module:
    """Built on the meta device by the factory itself, with nothing to recreate the table."""
    with torch.device("meta"):
        return Positions()


def meta_buffer_recreated() -> nn.Module:
    with torch.device("meta"):
        return RecreatedPositions()
