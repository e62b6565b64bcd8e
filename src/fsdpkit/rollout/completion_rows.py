"""Sampled completions laid out for the trainer: prompt + completion rows, which logits
score which completion token, and which tokens train.

[Note: rollout batches]
Row ``i`` is its prompt ``p_i`` followed by its completion ``c_i``, right-padded to the
micro-batch's longest row: causal attention never lets a padding token change an
earlier logit, so no attention mask is needed. The logit at position ``|p_i| - 1 + t``
predicts completion token ``t``; ``positions`` holds that index per (row, token), the
completion tokens are laid out (rows, T) with T the micro-batch's longest completion,
which is the (B, T) layout the GRPO losses take (fsdpkit.loss.grpo). ``sampled`` marks
every token the engine drew (the gap check's tokens); ``mask`` the tokens that train:
the sampled ones, minus every token of a truncated completion when
``rl.mask_truncated_completions`` (DAPO's overlong filtering). A completion keeps its
stop token (EOS): it trains the model to stop, as TRL's completion mask does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch


@dataclass(frozen=True)
class RolloutBatch:
    """One micro-batch of completions ([Note: rollout batches]), on one device."""

    inputs: torch.Tensor
    """(rows, L) int64: prompt + completion, right-padded with 0."""
    positions: torch.Tensor
    """(rows, T) int64: the logit index that predicts each completion token."""
    completion_ids: torch.Tensor
    """(rows, T) int64, 0 past each completion's end."""
    sampled: torch.Tensor
    """(rows, T) float: 1 where the engine drew a token."""
    mask: torch.Tensor
    """(rows, T) float: 1 where a token trains."""
    engine_logps: torch.Tensor
    """(rows, T) float32: the engine's log-probs of its tokens (0 past the end)."""
    advantages: torch.Tensor
    """(rows,) float32."""
    old_logps: torch.Tensor | None = None
    """(rows, T): the trainer's recomputation before any update (the sampling policy's
    log-probs for the importance ratio), filled in by the step."""
    ref_logps: torch.Tensor | None = None
    """(rows, T): the reference's, when rl.beta > 0."""

    @property
    def device(self) -> torch.device:
        return self.inputs.device

    @property
    def shape(self) -> torch.Size:
        return self.completion_ids.shape

    def with_logps(
        self, *, old: torch.Tensor | None = None, ref: torch.Tensor | None = None
    ) -> RolloutBatch:
        return replace(
            self,
            old_logps=old if old is not None else self.old_logps,
            ref_logps=ref if ref is not None else self.ref_logps,
        )


def rollout_batch(
    prompts: Sequence[np.ndarray],
    completions: Sequence[Sequence[int]],
    engine_logps: Sequence[Sequence[float]],
    *,
    advantages: torch.Tensor,
    trains: Sequence[bool],
    device: torch.device,
) -> RolloutBatch:
    """The rows of ``completions`` (``prompts[i]`` is completion ``i``'s prompt);
    ``trains[i]`` False masks completion ``i`` out of the loss."""
    rows = len(completions)
    width = max(len(c) for c in completions)
    length = max(len(p) + len(c) for p, c in zip(prompts, completions))
    inputs = np.zeros((rows, length), dtype=np.int64)
    positions = np.zeros((rows, width), dtype=np.int64)
    ids = np.zeros((rows, width), dtype=np.int64)
    sampled = np.zeros((rows, width), dtype=np.float32)
    logps = np.zeros((rows, width), dtype=np.float32)
    for i, (p, c, lp) in enumerate(zip(prompts, completions, engine_logps)):
        n = len(c)
        inputs[i, : len(p)], inputs[i, len(p) : len(p) + n] = p, c
        positions[i] = np.minimum(np.arange(width) + len(p) - 1, length - 1)
        ids[i, :n], sampled[i, :n], logps[i, :n] = c, 1.0, lp
    mask = sampled * np.asarray(trains, dtype=np.float32)[:, None]

    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return RolloutBatch(
        inputs=put(inputs),
        positions=put(positions),
        completion_ids=put(ids),
        sampled=put(sampled),
        mask=put(mask),
        engine_logps=put(logps),
        advantages=advantages.to(device=device, dtype=torch.float32),
    )


def completion_logits(logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(rows, T, vocab): the logits that predict each completion token."""
    index = positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    return logits.gather(1, index)
