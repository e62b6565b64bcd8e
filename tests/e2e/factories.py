"""Model factories used by the e2e tests through ``model.factory``."""

from __future__ import annotations

import os

import torch
from torch import nn

from support import MLPNet


def token_mlp() -> nn.Module:
    """A non-transformer LM over the byte vocabulary (residual-MLP blocks)."""
    return MLPNet(vocab=256)


class Exploding(MLPNet):
    """Raises on rank 1 at its third forward: a rank failing mid-training."""

    calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        Exploding.calls += 1
        if os.environ.get("RANK") == "1" and Exploding.calls == 3:
            raise RuntimeError("injected failure on rank 1")
        return super().forward(tokens)


def exploding() -> nn.Module:
    return Exploding(vocab=256)
