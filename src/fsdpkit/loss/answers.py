"""The loss of SFT micro-batches: next-token cross-entropy on the answer tokens only.

``sft_loss(model, batch)`` is the default loss when the data is SFT ([Note: SFT
batches] in fsdpkit.data.batch): the model reads ``batch.inputs`` (with
``position_ids=batch.positions`` when examples are packed, so attention stays inside
each example), and the loss is the mean cross-entropy over the targets that are not
``IGNORE_INDEX``, in fp32. A plain (batch, seq + 1) tensor falls back to
``next_token_loss``, so evaluation and sampling code need not care.

The loader's batches carry a ``normalizer`` ([Note: SFT loss weighting] in
fsdpkit.data.sft_loader): the sum of token losses is divided by it, so the gradient
averaged over ranks is that of the mean over all answer tokens of the micro-step,
whatever the world size. Without one, the mean over this micro-batch's answer tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdpkit.data.batch import IGNORE_INDEX, SFTBatch
from fsdpkit.loss.contract import logits_of, next_token_loss
from fsdpkit.pretrained import is_hf_model


def model_kwargs(model: nn.Module, batch: SFTBatch) -> dict[str, Any]:
    """What ``model(batch.inputs, ...)`` takes besides the ids (packed positions)."""
    kwargs: dict[str, Any] = {}
    if batch.positions is not None:
        kwargs["position_ids"] = batch.positions
        if is_hf_model(model):
            # transformers builds the block-diagonal mask from position-id resets only
            # without a KV cache (with one it silently attends across examples)
            kwargs["use_cache"] = False
    return kwargs


def _logits(model: nn.Module, batch: SFTBatch) -> torch.Tensor:
    return logits_of(model(batch.inputs, **model_kwargs(model, batch)), tokens=batch.inputs)


def sft_loss(model: nn.Module, batch: SFTBatch | torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens of ``batch`` (fp32 logits)."""
    if isinstance(batch, torch.Tensor):
        return next_token_loss(model, batch)
    logits = _logits(model, batch)
    flat = logits.float().reshape(-1, logits.shape[-1])
    if batch.normalizer is None:
        return F.cross_entropy(flat, batch.targets.reshape(-1), ignore_index=IGNORE_INDEX)
    total = F.cross_entropy(
        flat, batch.targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total / batch.normalizer


def token_losses(model: nn.Module, batch: SFTBatch) -> torch.Tensor:
    """(batch, seq) cross-entropy of every target (0 where ignored): per-example losses
    are sums over an example's positions (tests compare packed and unpacked this way)."""
    logits = _logits(model, batch)
    flat = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        batch.targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return flat.reshape(batch.targets.shape)
