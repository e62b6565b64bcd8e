"""One optimizer step: the function ``fsdpkit train`` runs and the planner traces.

Per micro-batch: the loss (``loss_fn(model, tokens)``, divided by the number of
micro-batches), its backward with gradient reduction on the last micro-batch only
(``accum_sync="last"``) or on every one (``"every"``; [Note: accumulation modes] in
fsdpkit.sharding.grads); then the fp16 scaler's unscale, global-norm clipping, the
optimizer step (through the scaler when there is one) and ``zero_grad(set_to_none)``.
The loss tensor dies before each backward returns, so logits never outlive their
micro-batch. The traced planner runs this very function under fake tensors with a
``mark`` hook at each phase end; the training loop runs it for real. Whatever it
keeps alive is what the planner's analytic model must account for
(fsdpkit.planner.analytic; bench/plan_accuracy.py checks the two agree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fsdpkit.models.factory import LossFn
from fsdpkit.sharding.grads import SyncMode, clip_grad_norm_, micro_batch

PHASES = ("forward", "backward", "optimizer step")
"""What ``mark`` is called with, in order, for each micro-batch (the last one only at
the end of the step)."""


@dataclass(frozen=True)
class StepResult:
    """This rank's view of one step, as 0-d tensors (read them when needed: a host
    sync on GPUs)."""

    loss: torch.Tensor
    """Mean loss of this rank's micro-batches (fp32, detached)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping (all shards and replicas)."""


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[torch.Tensor],
    *,
    loss_fn: LossFn,
    max_norm: float,
    keep_unsharded: bool = False,
    accum_sync: SyncMode = "last",
    scaler: torch.amp.GradScaler | None = None,
    foreach: bool = True,
    mark: Callable[[str], None] | None = None,
) -> StepResult:
    """One optimizer step over ``micro_batches`` (token ids, on the model's device)."""
    note = mark or (lambda _: None)
    last = len(micro_batches) - 1
    total = torch.zeros((), device=micro_batches[0].device)
    for i, tokens in enumerate(micro_batches):
        with micro_batch(
            model, last=i == last, accum_sync=accum_sync, keep_unsharded=keep_unsharded
        ):
            loss = loss_fn(model, tokens) / len(micro_batches)
            note("forward")
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss.detach().float()
            del loss
            note("backward")
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = clip_grad_norm_(model, max_norm, foreach=foreach)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    note("optimizer step")
    return StepResult(loss=total, grad_norm=norm)
