"""Context parallelism's side of the batch: each cp rank's slice of every sequence, and
the loss normalized so that FSDP's gradient mean equals the unsharded gradient.

[Note: context-parallel loss normalization]
The cp ranks of one data-parallel rank read the same micro-batch; each keeps the
contiguous slice ``[r * s / cp, (r + 1) * s / cp)`` of its inputs, targets and position
ids (``arange(s)`` when the batch has none, so RoPE and the whole-sequence mask see
global positions: [Note: Ulysses context parallelism] in fsdpkit.sharding.context.attention).
The attention exchange lets gradients flow between the cp ranks, so the sum of the
ranks' parameter gradients is the gradient of the sum of their losses; FSDP then
divides that sum by its dp x cp ranks. So each rank's loss must be
``cp x (its share of the unsharded loss)``:

- unsharded loss = sum of token losses / N, N = the normalizer of an SFT batch ([Note:
  SFT loss weighting] in fsdpkit.data.sft_loader), else the whole micro-batch's
  predicted tokens (plain token ids: batch x seq);
- rank loss = sum of its token losses / (N / cp). Its gradient, summed over cp ranks
  and divided by cp, is the unsharded gradient; the mean of the rank losses over cp
  is the unsharded loss, so logging the mean over ranks stays right.

For plain token batches (every slice holds the same number of tokens) this is the mean
over the rank's own tokens. N comes from the whole micro-batch, which every cp rank
holds before slicing, so no collective is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdpkit.data.batch import SFTBatch
from fsdpkit.errors import ConfigError
from fsdpkit.loss.answers import sft_loss
from fsdpkit.loss.contract import LossFn, next_token_loss
from fsdpkit.sharding.context.ring import head_tail_index


def slice_batch(
    batch: SFTBatch | torch.Tensor, *, rank: int, cp: int, ring: bool = False
) -> SFTBatch:
    """Rank ``rank``'s slice of ``batch`` (token ids (b, s + 1) or an SFTBatch), with
    global position ids and the normalizer of [Note: context-parallel loss
    normalization]. ``ring``: the head-tail chunks of [Note: ring attention]
    (fsdpkit.sharding.context.ring) instead of one contiguous slice; packed rows refused."""
    # plain token ids predict every token: their count is the shape's (b x s), read
    # without a host sync and traceable on fake tensors (the traced planner)
    plain = isinstance(batch, torch.Tensor)
    if isinstance(batch, torch.Tensor):
        batch = SFTBatch(inputs=batch[:, :-1], targets=batch[:, 1:])
    b, s = batch.inputs.shape
    if s % cp:
        raise ConfigError(
            f"parallel.cp = {cp} must divide the sequence length {s} of every batch: each "
            "context-parallel rank holds an equal slice. Set data.seq_len to a multiple "
            f"of {cp}."
        )
    positions = batch.positions
    if positions is None:
        positions = torch.arange(s, device=batch.device).expand(b, s)
    normalizer = batch.normalizer
    if normalizer is None:
        normalizer = b * s if plain else batch.target_count()
    part: slice | torch.Tensor = slice(rank * (s // cp), (rank + 1) * (s // cp))
    if ring:
        _refuse_packed(positions)
        part = head_tail_index(seq=s, cp=cp, rank=rank, device=positions.device)
    return SFTBatch(
        inputs=batch.inputs[:, part],
        targets=batch.targets[:, part],
        positions=positions[:, part],
        normalizer=normalizer / cp,
    )


def _refuse_packed(positions: torch.Tensor) -> None:
    """Ring attention is causal over the whole row ([Note: ring attention]): a row
    holding several examples (positions restarting, ``document_mask``'s rule) would let
    each example attend to the ones before it."""
    if bool((torch.diff(positions, dim=-1) != 1).any()):
        raise ConfigError(
            'parallel.cp_attention = "ring" attends causally over each whole row, so it '
            "cannot keep packed examples apart: this batch's rows hold several examples "
            "(position ids restart inside a row). Set data.pack = false, or "
            'parallel.cp_attention = "ulysses" (which applies the document mask).'
        )


@dataclass(frozen=True)
class ContextParallelLoss:
    """``inner`` on this cp rank's slice of every batch (``context_parallel_loss``). A
    dataclass rather than a closure so that code holding it can see, and replace, the
    loss it wraps (the traced planner adjusts a ChunkedLoss inside)."""

    inner: LossFn
    rank: int
    cp: int
    ring: bool = False

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.inner(model, slice_batch(batch, rank=self.rank, cp=self.cp, ring=self.ring))


def context_parallel_loss(loss_fn: LossFn, *, mesh: DeviceMesh, ring: bool = False) -> LossFn:
    """``loss_fn`` on this cp rank's slice of every batch (``slice_batch``; ``mesh``:
    the cp sub-mesh). ``loss_fn`` receives an SFTBatch with a normalizer, as
    ``sft_loss`` and ``ChunkedLoss`` take it; ``next_token_loss`` is replaced by
    ``sft_loss``, which computes the same loss from the same tokens."""
    inner = sft_loss if loss_fn is next_token_loss else loss_fn
    return ContextParallelLoss(inner=inner, rank=mesh.get_local_rank(), cp=mesh.size(), ring=ring)
