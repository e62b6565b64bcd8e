"""One optimizer step, and one evaluation, of a pipelined model (``parallel.pp``): the
pipeline's counterparts of ``fsdpkit.trainable.step.train_step`` and the loop's
evaluation, with the same result.

[Note: the pipelined step]
Every rank of a pipeline group gets the same micro-batches (they share a
data-parallel coordinate: fsdpkit.config.dims) and hands them to its stages; the
schedule runs forwards and backwards in its order ([Note: a stage's forward] in
fsdpkit.sharding.pipeline.stages). Then, as in ``train_step``:

- the step's loss is the sum of the last stage's micro-batch losses (each already
  divided by the micro-batch count), summed over the pipeline group so every rank
  reports the same number (the other stages contribute zero);
- a tied embedding and head: the first and last stages' gradients of their copies
  are summed (where one rank holds both, its last copy first takes the first's
  values: [Note: tied embeddings across stages] in fsdpkit.sharding.pipeline.tied);
- global-norm clipping over every stage: each rank's squared gradient norm (over its
  stages' shards, reduced over the stage's own ranks as without pp) is summed over the
  pipeline group before the square root, so the norm, and the clipping factor, are
  those of the whole model (``clip_grad_norm_(..., across=group)``; a tied weight's
  last-stage copy is not counted again);
- the optimizer steps each rank's own parameters, and zero_grad.

[Note: pipelined evaluation]
Evaluation runs forwards only, one micro-batch after another through the stages in
order, each stage's hidden state sent to the rank of the next (a header with its
shape and dtype, then the tensor): no schedule, so it works for every stage layout
(torch's V schedules cannot run in eval mode, 1F1B refuses fewer micro-batches than
stages) and any number of validation batches, without overlap (evaluation is rare).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdpkit.loss.contract import LossFn
from fsdpkit.sharding.grads import clip_grad_norm_
from fsdpkit.sharding.pipeline.stages import Pipeline
from fsdpkit.sharding.pipeline.tied import refresh_twin, sum_tied_grads
from fsdpkit.trainable.step import StepResult


def _train(pipe: Pipeline, micro_batches: Sequence[Any]) -> torch.Tensor:
    """Run the schedule over ``micro_batches``; their summed loss (each divided by
    their count) on every pipeline rank."""
    n = len(micro_batches)
    for stage in pipe.stages:
        stage.batches, stage.mean_over = micro_batches, n
    order = torch.arange(n)  # the first stage's (unread) input per micro-batch
    losses: list[torch.Tensor] = []
    try:
        pipe.schedule.step(order, target=order, losses=losses, return_outputs=False)
    finally:
        for stage in pipe.stages:
            stage.batches = ()
    total = torch.zeros((), device=micro_batches[0].device)
    for loss in losses:
        total += loss.detach().float()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pipe.group)
    return total


def pipeline_step(
    pipe: Pipeline,
    view: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Any],
    *,
    max_norm: float,
    foreach: bool = True,
) -> StepResult:
    """One optimizer step over ``micro_batches`` ([Note: the pipelined step]); ``view``
    holds this rank's parameters. The count must be the schedule's."""
    if len(micro_batches) != pipe.micro_batches:
        raise ValueError(
            f"the pipeline schedule runs {pipe.micro_batches} micro-batches a step, got "
            f"{len(micro_batches)}"
        )
    refresh_twin(pipe.tied)
    total = _train(pipe, micro_batches)
    tied = pipe.tied
    if tied is not None:  # [Note: tied embeddings across stages]
        sum_tied_grads(tied)
    norm = clip_grad_norm_(
        view, max_norm, foreach=foreach, across=pipe.group, skip=pipe.uncounted()
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=total, grad_norm=norm)


@torch.no_grad()
def forward_only(
    pipe: Pipeline, micro_batches: Sequence[Any], *, last: LossFn | None = None
) -> list[torch.Tensor | None]:
    """Each micro-batch through the stages in order, forwards only ([Note: pipelined
    evaluation]); the last stage's output per micro-batch on the rank that holds it
    (None elsewhere). ``last``: what the last stage computes instead of the run's loss
    (then not divided by the micro-batch count)."""
    n, split = len(micro_batches), pipe.split
    me = dist.get_rank(pipe.group)
    local = {stage.stage: stage for stage in pipe.stages}
    outs: list[torch.Tensor | None] = [None] * n
    refresh_twin(pipe.tied)
    swapped = {stage: stage.loss_fn for stage in pipe.stages if stage.last and last is not None}
    for stage in pipe.stages:
        stage.eval()
        stage.batches, stage.mean_over = micro_batches, 1 if last is not None else n
        if stage in swapped:
            stage.loss_fn = last  # type: ignore[assignment]
    try:
        for i in range(n):
            handoff: Any = torch.tensor([i])  # the first stage's (unread) input
            for s in split.local(me):
                if s > 0 and split.ranks[s - 1] != me:
                    like = torch.zeros((), device=micro_batches[0].device)
                    handoff = _receive(src=split.ranks[s - 1], group=pipe.group, like=like)
                local[s].micro_batch = i
                out = local[s](handoff)
                if s == split.stages - 1:
                    outs[i] = out
                elif split.ranks[s + 1] == me:
                    handoff = out
                else:
                    _send(out, dst=split.ranks[s + 1], group=pipe.group)
    finally:
        for stage in pipe.stages:
            stage.train()
            stage.batches = ()
            if stage in swapped:
                stage.loss_fn = swapped[stage]
    return outs


@torch.no_grad()
def pipeline_eval(pipe: Pipeline, micro_batches: Sequence[Any]) -> torch.Tensor:
    """The mean loss of ``micro_batches``, the same number on every rank of the pipeline
    group: the loop's evaluation under pp ([Note: pipelined evaluation])."""
    total = torch.zeros((), device=micro_batches[0].device)
    for out in forward_only(pipe, micro_batches):
        if out is not None:
            total += out.float()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pipe.group)
    return total


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8
"""A hidden state's header: rank, up to six sizes, dtype index."""


def _send(tensor: torch.Tensor, *, dst: int, group: Any) -> None:
    sizes = [*tensor.shape, *[0] * (_HEADER - 2 - tensor.dim())]
    header = [tensor.dim(), *sizes, _DTYPES.index(tensor.dtype)]
    dist.send(torch.tensor(header, device=tensor.device), group_dst=dst, group=group)
    dist.send(tensor.contiguous(), group_dst=dst, group=group)


def _receive(*, src: int, group: Any, like: torch.Tensor) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=like.device)
    dist.recv(header, group_src=src, group=group)
    dim, *rest = (int(v) for v in header.tolist())
    out = torch.empty(rest[:dim], dtype=_DTYPES[rest[-1]], device=like.device)
    dist.recv(out, group_src=src, group=group)
    return out
