"""One step of the run's objective, and evaluation: what the loop calls each step.

``run_step`` is one optimizer step on the next micro-batches, dispatched on how the
run is built: the pipelined step under ``parallel.pp`` ([Note: the pipelined step]),
else ``fsdpkit.trainable.step.train_step`` (the function the planner traces) with the
objective's loss (next-token, SFT, DPO). The logged loss is the mean over all ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from fsdpkit.observe.breakdown import DATA_NAME
from fsdpkit.runtime.hangs import HangProbe
from fsdpkit.sharding.policy import sync_mode
from fsdpkit.train.session import Session
from fsdpkit.trainable.pipeline.step import pipeline_eval, pipeline_step
from fsdpkit.trainable.step import train_step


def _global_mean(value: torch.Tensor) -> float:
    if dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return float(value)


def run_step(s: Session, probe: HangProbe) -> tuple[float, float, dict[str, float]]:
    """One optimizer step on the next micro-batches; (mean loss over ranks, grad norm,
    the objective's own metrics: DPO rewards). The scheduler steps too, so read the
    step's LR before calling this."""
    with record_function(DATA_NAME):  # the profiler's "data" category
        batches = [b.to(s.device, non_blocking=True) for b in s.loader.next_step()]
    if s.trainable.pipeline is not None:  # [Note: the pipelined step]
        result = pipeline_step(
            s.trainable.pipeline,
            s.trainable.model,
            s.trainable.optimizer,
            batches,
            max_norm=s.cfg.train.grad_clip,
        )
        s.scheduler.step()
        return _global_mean(result.loss), float(result.grad_norm), {}
    result = train_step(
        s.trainable.model,
        s.trainable.optimizer,
        batches,
        loss_fn=s.trainable.loss_fn,
        max_norm=s.cfg.train.grad_clip,
        keep_unsharded=s.cfg.parallel.accum_keep_unsharded,
        accum_sync=sync_mode(s.cfg.parallel.accum_sync),
        scaler=s.scaler,
        mark=probe.marker(len(batches)),
    )
    s.scheduler.step()
    metrics = getattr(
        s.trainable.loss_fn, "step_metrics", None
    )  # DPO's rewards (collective), MoE's router
    extra = metrics() if metrics is not None else {}
    return _global_mean(result.loss), float(result.grad_norm), extra


@torch.no_grad()
def evaluate(s: Session) -> float | None:
    """Mean validation loss over the fixed validation batches of every rank."""
    if not s.val:
        return None
    if s.trainable.pipeline is not None:
        return _global_mean(pipeline_eval(s.trainable.pipeline, [t.to(s.device) for t in s.val]))
    s.trainable.model.eval()
    total = torch.zeros((), device=s.device)
    for tokens in s.val:
        total += s.trainable.loss_fn(s.trainable.model, tokens.to(s.device)).float()
    s.trainable.model.train()
    return _global_mean(total / len(s.val))
