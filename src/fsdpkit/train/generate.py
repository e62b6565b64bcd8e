"""A few lines of sample text from the trained built-in LM (greedy-free sampling).

Every rank runs the same forward passes (FSDP needs all ranks in each all-gather);
only rank 0 prints. Sampling uses a fixed generator so every rank draws the same token.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdpkit.data import Tokenizer


@torch.no_grad()
def sample(
    model: nn.Module,
    tokenizer: Tokenizer,
    *,
    prompt: str,
    max_new_tokens: int,
    context: int,
    device: torch.device,
    temperature: float = 0.8,
    seed: int = 0,
    multiple_of: int = 1,
) -> str:
    """Continue ``prompt`` by ``max_new_tokens`` tokens (top-k 40, temperature).
    ``multiple_of``: right-pad each window to a multiple of this many tokens (sequence
    parallelism splits the sequence evenly over the tp ranks); a causal model's logits
    before the padding do not see it."""
    gen = torch.Generator().manual_seed(seed)
    ids = tokenizer.encode(prompt)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        tail = ids[-context:]
        padded = tail + [0] * (-len(tail) % multiple_of)
        window = torch.tensor([padded], device=device)
        logits = model(window)[0, len(tail) - 1].float().cpu() / temperature
        top = torch.topk(logits, k=min(40, logits.numel()))
        probs = torch.softmax(top.values, dim=-1)
        ids.append(int(top.indices[torch.multinomial(probs, 1, generator=gen)]))
    model.train(was_training)
    return tokenizer.decode(ids)
