"""Model factories used by the e2e tests through ``model.factory``."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


class ResidualMLP(nn.Module):
    """A non-transformer block: LayerNorm -> MLP with a residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TokenMLP(nn.Module):
    """Bag-of-previous-token MLP LM: causal by construction (each position sees itself)."""

    def __init__(self, vocab: int = 256, dim: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(ResidualMLP(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def token_mlp() -> nn.Module:
    return TokenMLP()


class Exploding(TokenMLP):
    """Raises on rank 1 at its third forward: a rank failing mid-training."""

    calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        Exploding.calls += 1
        if os.environ.get("RANK") == "1" and Exploding.calls == 3:
            raise RuntimeError("injected failure on rank 1")
        return super().forward(tokens)


def exploding() -> nn.Module:
    return Exploding()
