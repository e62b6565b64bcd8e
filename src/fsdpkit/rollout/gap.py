"""The log-prob gap: the engine's log-probs of its sampled tokens against the trainer's
recomputation with the same weights, every step.

[Note: the log-prob gap]
An engine reports, with every token it samples, that token's log-prob under the
weights it sampled with (temperature applied, the whole vocabulary). Before any
update of a step the trainer recomputes the same quantity with its own forward over
prompt + completion (fsdpkit.loss.logprobs), which it needs anyway as the sampling
policy's log-probs. If the engine sampled with the weights the trainer holds, the two
agree to float noise: KV-cached incremental attention against a full causal forward,
on another batch shape (fp32: ~1e-6 nats). A weight update that never reached the
engine, reached it stale, partly, corrupted or in the wrong dtype shows as a gap
orders of magnitude larger, on the very first step after it. So each step logs
``rl/logprob_gap_mean`` and ``rl/logprob_gap_max`` (over every sampled token of every
rank, masked tokens included: the engine sampled them all), and a step whose max
gap exceeds ``rl.logprob_gap_max`` stops the run before it trains on those samples:
an off-policy step never happens silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdpkit.errors import UserError


class LogprobGapError(UserError, RuntimeError):
    """The engine sampled with other weights than the trainer holds."""


@dataclass(frozen=True)
class Gap:
    """The step's gap over every rank's sampled tokens."""

    mean: float
    max: float
    tokens: int


def logprob_gap(
    engine: Sequence[torch.Tensor],
    trainer: Sequence[torch.Tensor],
    sampled: Sequence[torch.Tensor],
) -> Gap:
    """|engine - trainer| over the ``sampled`` positions (per micro-batch: (rows,
    tokens) masks of every token the engine drew), over every rank; collective."""
    total = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    peak = torch.zeros((), dtype=torch.float64)
    for e, t, m in zip(engine, trainer, sampled):
        diff = (e.double() - t.detach().double()).abs().cpu() * m.double().cpu()
        total += diff.sum()
        count += m.double().sum().cpu()
        peak = torch.maximum(peak, diff.max()) if diff.numel() else peak
    stats = torch.stack([total, count])
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = engine[0].device if engine else torch.device("cpu")
        stats, peak = stats.to(device), peak.to(device)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens = int(stats[1])
    return Gap(mean=float(stats[0]) / max(tokens, 1), max=float(peak), tokens=tokens)


def check_gap(gap: Gap, *, limit: float, step: int, engine: str, checkpoint_note: str) -> None:
    """Stop before training on samples the trainer's weights did not produce ([Note:
    the log-prob gap])."""
    if gap.max <= limit:
        return
    raise LogprobGapError(
        f"step {step}: the rollout engine ({engine}) sampled with other weights than the "
        f"trainer holds: the largest gap between the engine's log-prob of a sampled token "
        f"and the trainer's recomputation is {gap.max:.3g} nats (mean {gap.mean:.3g} over "
        f"{gap.tokens:,} tokens), above rl.logprob_gap_max = {limit:g}. Training on these "
        "samples would be a silently off-policy step, so the run stopped before it. A "
        "weight update that did not reach the engine (stale, partial, corrupted or in "
        "another dtype) looks like this; so does a model whose incremental decoding "
        "differs from its full forward. In bf16, float noise alone can reach ~0.1: read "
        "rl/logprob_gap_max in metrics.jsonl and raise rl.logprob_gap_max above it if "
        f"that is what you see. {checkpoint_note}"
    )
