"""Factories that build the same models on the meta device and on the CPU (``model.factory``
specs for the meta-build tests): a residual MLP with a non-persistent position table, and
a transformers Llama whose RoPE tables are non-persistent."""

from __future__ import annotations

import math

import torch
from torch import nn

from fsdpkit import init_weights, meta_params
from support import MLPNet

VOCAB = 256


class PositionalMLP(MLPNet):
    """``MLPNet`` plus a fixed sinusoidal position table: a non-persistent buffer that no
    checkpoint holds (like RoPE's ``inv_freq``)."""

    def __init__(self, max_len: int = 64) -> None:
        super().__init__(vocab=VOCAB)
        dim = self.embed.embedding_dim
        pos = torch.arange(max_len, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(1e4) / dim))
        table = torch.zeros(max_len, dim)
        table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
        self.register_buffer("positions", table, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.positions[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def positional_mlp_cpu() -> nn.Module:
    model = PositionalMLP()
    init_weights(model, seed=0)  # what materializing a meta build gives with train.seed 0
    return model


def positional_mlp_meta() -> nn.Module:
    with meta_params():
        return PositionalMLP()


def positional_mlp_bare_meta() -> nn.Module:
    with torch.device("meta"):
        return PositionalMLP()


def _llama_config() -> object:
    from tiny_hf import tiny_config

    return tiny_config("llama", vocab_size=VOCAB, dim=32)


def hf_llama_cpu() -> nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(_llama_config())


def hf_llama_meta() -> nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(_llama_config())
