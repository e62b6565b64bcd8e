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
(fsdpkit.planner.replay.analytic; bench/plan_accuracy.py checks the two agree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdpkit.config import RunConfig, batch_split
from fsdpkit.loss.contract import LossFn
from fsdpkit.sharding.grads import clip_grad_norm_, micro_batch
from fsdpkit.sharding.policy import SyncMode, sync_mode

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
    micro_batches: Sequence[Any],
    *,
    loss_fn: LossFn,
    max_norm: float,
    keep_unsharded: bool = False,
    accum_sync: SyncMode = "last",
    scaler: torch.amp.GradScaler | None = None,
    foreach: bool = True,
    mark: Callable[[str], None] | None = None,
    average: bool = True,
) -> StepResult:
    """One optimizer step over ``micro_batches`` (token ids or an objective's batches,
    on the model's device). ``average``: the step's loss is the mean of the micro-batch
    losses; False: their sum (a loss normalized over the whole step already, as GRPO's:
    [Note: GRPO loss normalization] in fsdpkit.loss.grpo)."""
    note = mark or (lambda _: None)
    last = len(micro_batches) - 1
    share = len(micro_batches) if average else 1
    total = torch.zeros((), device=micro_batches[0].device)
    for i, tokens in enumerate(micro_batches):
        with micro_batch(
            model, last=i == last, accum_sync=accum_sync, keep_unsharded=keep_unsharded
        ):
            loss = loss_fn(model, tokens) / share
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


def step_options(cfg: RunConfig) -> dict[str, Any]:
    """The ``train_step`` settings a config asks for: clipping, accumulation mode and
    whether parameters stay unsharded between micro-batches. The loop, the planner's
    trace and its measurement all read them here."""
    return {
        "max_norm": cfg.train.grad_clip,
        "keep_unsharded": cfg.parallel.accum_keep_unsharded,
        "accum_sync": sync_mode(cfg.parallel.accum_sync),
    }


def synthetic_batches(
    cfg: RunConfig,
    *,
    dp_world: int,
    vocab_size: int,
    at_most: int | None = None,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """One step's micro-batches of random token ids in the run's shape (micro-batch x
    seq_len + 1, ``batch_split`` at ``dp_world``): what the planner traces and measures.
    ``at_most`` caps the count (the trace: later micro-batches hold what the second does)."""
    split = batch_split(cfg.train, dp_world=dp_world)
    count = split.grad_accum if at_most is None else min(split.grad_accum, at_most)
    size = (split.micro_batch, cfg.data.seq_len + 1)
    return [torch.randint(0, vocab_size, size, generator=generator) for _ in range(count)]
