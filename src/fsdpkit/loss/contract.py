"""The loss contract: what a loss receives, where the logits are, the default loss.

A loss is ``loss_fn(module, batch) -> scalar tensor``: ``batch`` is a (batch, seq + 1)
tensor of token ids, or an ``SFTBatch`` for SFT data; it calls ``module(...)`` itself
(the FSDP root, so its hooks gather the parameters). A model's output holds the logits
as a tensor, ``.logits``, ``["logits"]`` or the first element of a tuple ([Note:
factory contract] in fsdpkit.models.factory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdpkit.data.batch import IGNORE_INDEX
from fsdpkit.models.errors import ModelError

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(module, batch) -> scalar``: batch is token ids or an ``SFTBatch``."""


class ModelOutputError(ModelError):
    """The model's forward returned something that holds no logits."""


def logits_of(output: Any, *, tokens: torch.Tensor) -> torch.Tensor:
    """The logits in a model's output (see [Note: factory contract] in
    fsdpkit.models.factory); a clear error naming what came back otherwise."""
    found = output
    if not isinstance(found, torch.Tensor):
        if isinstance(found, dict) and "logits" in found:
            found = found["logits"]
        elif getattr(found, "logits", None) is not None:
            found = found.logits
        elif isinstance(found, tuple | list) and found:
            found = found[0]
    if isinstance(found, torch.Tensor) and found.dim() == 3 and found.shape[:2] == tokens.shape:
        return found
    got = type(output).__name__ + (
        f" with shape {tuple(found.shape)}" if isinstance(found, torch.Tensor) else ""
    )
    raise ModelOutputError(
        f"the model returned {got} for input ids of shape {tuple(tokens.shape)}; fsdpkit needs "
        f"logits of shape (batch, seq, vocab) = ({tokens.shape[0]}, {tokens.shape[1]}, vocab): "
        "return them as a tensor, or as .logits / ['logits'] / the first element of a tuple, "
        "or return (module, loss_fn) from the factory with loss_fn(module, tokens) computing "
        "the loss itself. See docs/models.md."
    )


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1] (fp32 logits);
    labels equal to ``IGNORE_INDEX`` are skipped."""
    inputs = tokens[:, :-1]
    logits = logits_of(model(inputs), tokens=inputs)
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        tokens[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
    )
