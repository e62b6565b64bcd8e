"""The training step the planner models, shared by the traced planner and bench/.

It is the step of ``fsdpkit.train.loop.train_step`` without the session around it:
per micro-batch ``next_token_loss`` (the trainer's; the logits die inside it, before
backward), backward with gradient reduction only on the last micro-batch, global-norm
clipping, AdamW (built by ``fsdpkit.train.optim.build_optimizer``), and
``zero_grad(set_to_none=True)``. If the training loop changes what it keeps alive,
update this file and the analytic model together (bench/plan_accuracy.py checks both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from fsdpkit.models.factory import next_token_loss
from fsdpkit.sharding import gradient_sync


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[torch.Tensor],
    *,
    keep_unsharded: bool = False,
    max_norm: float = 1.0,
    foreach: bool = True,
    mark: Callable[[str], None] | None = None,
) -> None:
    """One optimizer step over ``micro_batches``; ``mark(phase)`` is called at the end
    of each phase ("forward", "backward", "optimizer step") of every micro-batch.
    ``foreach=False`` clips tensor by tensor: the same memory on real tensors (only
    per-tensor norms are allocated), but fake-tensor tracing of the foreach kernels
    on DTensors counts a copy of every gradient."""
    note = mark or (lambda _: None)
    last = len(micro_batches) - 1
    for i, tokens in enumerate(micro_batches):
        with gradient_sync(model, enabled=i == last, keep_unsharded=keep_unsharded):
            loss = next_token_loss(model, tokens) / len(micro_batches)
            note("forward")
            loss.backward()
            del loss
            note("backward")
    params = [p for p in model.parameters() if p.grad is not None]
    torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=foreach)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    note("optimizer step")
