"""Gradient reduction across micro-batches, and the true global grad norm.

[Note: accumulation modes]
With k micro-batches per optimizer step FSDP2 offers two ways to accumulate
(``parallel.accum_sync``):

- ``last`` (no-sync): micro-batches 1..k-1 skip the reduce-scatter (and HSDP's
  all-reduce); every parameter's unsharded gradient, in the reduce dtype, stays
  alive until the last micro-batch reduces the sum. Traffic: one reduce-scatter per
  unit per step. Memory: a full unsharded gradient of the whole model between
  micro-batches.
- ``every``: every micro-batch reduce-scatters; the sharded gradients accumulate
  (FSDP2 adds each reduce-scatter output into ``param.grad``). Traffic: k
  reduce-scatters per unit per step. Memory: sharded gradients only (1/shard of the
  above). Under HSDP the all-reduce across replicas still runs on the last
  micro-batch only (``set_requires_all_reduce``): FSDP2 keeps the partial sum of
  the reduce-scatter outputs, sharded, and all-reduces it once.

``parallel.accum_keep_unsharded`` is independent of both: it skips the reshard after
backward on non-final micro-batches (no all-gather in the next forward, full
parameters held), whichever way gradients are reduced.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdpkit.sharding.policy import SyncMode


@contextmanager
def _fsdp_flags(
    model: nn.Module, *, reduce: bool, all_reduce: bool, reshard: bool
) -> Iterator[None]:
    """Set FSDP2's per-backward switches on every unit, restoring the defaults after."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_requires_gradient_sync(reduce)  # sets all-reduce to the same value
    if reduce and not all_reduce:
        model.set_requires_all_reduce(False)
    if not reshard:
        model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


@contextmanager
def micro_batch(
    model: nn.Module, *, last: bool, accum_sync: SyncMode = "last", keep_unsharded: bool = False
) -> Iterator[None]:
    """Run one micro-batch's backward as the step's accumulation mode requires (see
    [Note: accumulation modes]); ``last`` marks the step's final micro-batch."""
    with _fsdp_flags(
        model,
        reduce=last or accum_sync == "every",
        all_reduce=last,
        reshard=last or not keep_unsharded,
    ):
        yield


@contextmanager
def gradient_sync(
    model: nn.Module, *, enabled: bool, keep_unsharded: bool = False
) -> Iterator[None]:
    """Run one micro-batch's backward with or without gradient reduction (the
    ``last`` mode of [Note: accumulation modes]).

    ``enabled=False`` (every micro-batch but the last) skips the reduce-scatter (and
    HSDP's all-reduce): gradients accumulate unsharded locally. ``keep_unsharded``
    also skips resharding after backward, so the next forward needs no all-gather,
    at the cost of holding full parameters between micro-batches.
    """
    with micro_batch(model, last=enabled, keep_unsharded=keep_unsharded):
        yield


def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    *,
    foreach: bool = True,
    across: Any = None,
    skip: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip to ``max_norm`` (0 = measure only); the global L2 norm of all gradients
    across every shard and replica, as a 0-d tensor (no host sync).

    Gradients on different meshes or placements (tensor parallelism: split block
    weights and replicated norms on the data x tp mesh, the embedding and head on the
    data mesh alone) are normed per group, each group's norm made whole over its
    mesh, then combined: DTensor cannot stack norms of different meshes, and
    miscounts mixed placements (``_by_mesh``). ``across``: a process group whose ranks
    hold *different* parameters (the pipeline stages): the squared norms are summed
    over it, so every rank clips by the whole model's norm ([Note: the pipelined
    step] in fsdpkit.trainable.pipeline.step); ``skip``: parameters another rank of
    ``across`` counts (a tied weight's second copy), clipped but not counted.
    ``foreach=False`` computes per-tensor
    norms: the same memory on real tensors, but fake-tensor tracing (the planner)
    counts a copy of every gradient for the foreach kernels on DTensors."""
    params: list[torch.Tensor] = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros(())
    limit = max_norm if max_norm > 0 else float("inf")
    groups = _by_mesh(params)
    if len(groups) == 1 and across is None:
        total = torch.nn.utils.clip_grad_norm_(params, limit, foreach=foreach)
        return total.full_tensor() if isinstance(total, DTensor) else total
    _quiet_redistribute()
    norms = []
    skipped = {id(p) for p in skip}
    for group in groups:
        grads = [p.grad for p in group if p.grad is not None and id(p) not in skipped]
        if not grads:
            continue
        norm = torch.nn.utils.get_total_norm(grads, foreach=foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if across is not None:
        squared = total.square()
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=across)
        total = squared.sqrt()
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, limit, total, foreach=foreach)
    return total


class _SequentialReduceNotice(logging.Filter):
    """Drops DTensor's notice that a norm partial over two mesh axes is reduced in two
    all-reduces: for 0-d norms the cost is nil, and the notice would print once per
    rank at every tensor-parallel run's first step."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_reduce" not in record.getMessage()


_NOTICE = _SequentialReduceNotice()


def _quiet_redistribute() -> None:
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    if _NOTICE not in logger.filters:
        logger.addFilter(_NOTICE)


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped by their gradients' device mesh and placements (plain tensors
    together): DTensor's norm of a list mixing a replicated and a sharded placement on
    one mesh axis counts the replicated one once per rank of that axis."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip to ``max_norm`` (0 = measure only) and return the global L2 norm of all
    gradients across every shard and replica, as a plain float."""
    return float(clip_grad_norm_(model, max_norm))
