"""Gradient accumulation without communication, and the true global grad norm."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


@contextmanager
def gradient_sync(
    model: nn.Module, *, enabled: bool, keep_unsharded: bool = False
) -> Iterator[None]:
    """Run one micro-batch's backward with or without gradient reduction.

    ``enabled=False`` (every micro-batch but the last) skips the reduce-scatter (and
    HSDP's all-reduce): gradients accumulate unsharded locally. ``keep_unsharded``
    also skips resharding after backward, so the next forward needs no all-gather,
    at the cost of holding full parameters between micro-batches.
    """
    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_requires_gradient_sync(enabled)
    if keep_unsharded:
        model.set_reshard_after_backward(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        if keep_unsharded:
            model.set_reshard_after_backward(True)


def clip_grad_norm_(model: nn.Module, max_norm: float, *, foreach: bool = True) -> torch.Tensor:
    """Clip to ``max_norm`` (0 = measure only); the global L2 norm of all gradients
    across every shard and replica, as a 0-d tensor (no host sync).

    ``foreach=False`` computes per-tensor norms: the same memory on real tensors, but
    fake-tensor tracing (the planner) counts a copy of every gradient for the foreach
    kernels on DTensors."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros(())
    limit = max_norm if max_norm > 0 else float("inf")
    total = torch.nn.utils.clip_grad_norm_(params, limit, foreach=foreach)
    return total.full_tensor() if isinstance(total, DTensor) else total


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip to ``max_norm`` (0 = measure only) and return the global L2 norm of all
    gradients across every shard and replica, as a plain float."""
    return float(clip_grad_norm_(model, max_norm))
