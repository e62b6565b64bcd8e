"""How a rollout draws its tokens: the sampling settings, one seed per completion, and
the draw itself.

[Note: world-size-independent samples]
A completion's tokens must not depend on how many ranks generate, or which rank draws
it: a 2-rank run then samples exactly what one process samples, a resumed run samples
what the uninterrupted one would have, and no checkpoint needs to carry a sampler's
state. So every completion owns its random stream: a generator seeded by
``completion_seed(seed, step, position, index)`` (the run's seed, the step, the prompt's
position in the step's prompt list, the completion's index in its group), and each
token is the Gumbel-max draw ``argmax(z / T + g)`` over the filtered logits with ``g``
from that generator alone: one ``vocab``-long uniform draw per token, whatever the batch
the row is computed in. ``argmax(z / T + g)`` with ``g = -log(-log u)`` samples exactly
``softmax(z / T)`` restricted to the tokens top-k / top-p keep.

The log-prob kept with each token is ``log_softmax(z / T)`` of the sampled token over
the whole vocabulary, before top-k / top-p: the quantity the trainer recomputes
(fsdpkit.loss.logprobs, as TRL computes it), so the two can be compared token for
token ([Note: the log-prob gap] in fsdpkit.rollout.gap).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """What one rollout samples with (from ``[rl]``)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: off."""
    stop_ids: frozenset[int] = frozenset()
    """Token ids that end a completion (kept in it): the tokenizer's EOS and the
    model's generation config's end tokens."""
    stop_strings: tuple[str, ...] = ()
    """Texts that end a completion once its decoded text ends with one (kept in it)."""


def completion_seed(*, seed: int, step: int, position: int, index: int) -> int:
    """The seed of completion ``index`` of the prompt at ``position`` in step ``step``'s
    prompt list ([Note: world-size-independent samples]): a hash, so nearby steps and
    prompts get unrelated streams."""
    key = f"fsdpkit-rollout:{seed}:{step}:{position}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def generators(seeds: Sequence[int], *, device: torch.device) -> list[torch.Generator]:
    """One generator per completion, on the device the logits live on."""
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


def filtered(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` (rows, vocab) with every token top-k / top-p drop set to -inf (the
    kept set is the same as transformers' TopK / TopP warpers: ties at the k-th value
    kept, the smallest prefix of sorted probabilities reaching top_p kept)."""
    out = logits
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(out, dim=-1, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= top_p  # the mass before a token is full
        out = out.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return out


def draw(
    scaled: torch.Tensor, *, sampling: Sampling, streams: Sequence[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``scaled`` (rows, vocab: fp32 logits already divided by the
    temperature) and its log-prob under ``log_softmax(scaled)`` ([Note:
    world-size-independent samples]). Row ``i`` draws from ``streams[i]`` only."""
    kept = filtered(scaled, top_k=sampling.top_k, top_p=sampling.top_p)
    uniform = torch.stack(
        [
            torch.rand(scaled.shape[-1], generator=g, device=scaled.device, dtype=torch.float64)
            for g in streams
        ]
    )
    gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))
    tokens = (kept.double() + gumbel).argmax(-1)
    logps = torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logps
