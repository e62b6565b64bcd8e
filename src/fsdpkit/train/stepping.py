"""One step of the run's objective, and evaluation: what the loop calls each step.

``run_step`` is one step on the next batches, dispatched on how the run is built: the
pipelined step under ``parallel.pp`` ([Note: the pipelined step]), GRPO's rollout and
updates under ``train.objective = grpo`` ([Note: the GRPO step] in fsdpkit.train.rl_step),
else ``fsdpkit.trainable.step.train_step`` (the function the planner traces) with the
objective's loss (next-token, SFT, DPO). The logged loss is the mean over all ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from fsdpkit.loss.advantages import group_advantages
from fsdpkit.loss.contract import LossFn
from fsdpkit.loss.grpo import loss_denominator
from fsdpkit.observe.breakdown import DATA_NAME
from fsdpkit.rollout.gap import check_gap, logprob_gap
from fsdpkit.runtime.failures import newest_checkpoint_note
from fsdpkit.runtime.hangs import HangProbe
from fsdpkit.sharding.policy import sync_mode
from fsdpkit.train.rl_build import sync_metrics
from fsdpkit.train.rl_step import (
    GrpoLoss,
    RlRun,
    gather_rewards,
    global_counts,
    held_out,
    micro_batches,
    recompute,
    reference_logps,
    rollout_metrics,
    sample,
    summed_metrics,
)
from fsdpkit.train.session import Session
from fsdpkit.trainable.pipeline.preference import reference_pass
from fsdpkit.trainable.pipeline.step import pipeline_eval, pipeline_step
from fsdpkit.trainable.reference import DpoLoss
from fsdpkit.trainable.step import StepResult, train_step


@dataclass(frozen=True)
class StepOutcome:
    """What one step reports."""

    loss: float
    """The step's loss, mean over ranks."""
    grad_norm: float
    metrics: dict[str, float] = field(default_factory=dict)
    """The objective's own (DPO's rewards, the router's, GRPO's rl/*)."""
    tokens: int | None = None
    """Tokens trained this step over every rank (None: global batch x seq_len)."""


def _global_mean(value: torch.Tensor) -> float:
    if dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return float(value)


def _train(
    s: Session,
    batches: Sequence[Any],
    *,
    probe: HangProbe,
    loss_fn: LossFn | None = None,
    average: bool = True,
) -> StepResult:
    """``train_step`` with the run's settings."""
    return train_step(
        s.trainable.model,
        s.trainable.optimizer,
        batches,
        loss_fn=loss_fn or s.trainable.loss_fn,
        max_norm=s.cfg.train.grad_clip,
        keep_unsharded=s.cfg.parallel.accum_keep_unsharded,
        accum_sync=sync_mode(s.cfg.parallel.accum_sync),
        scaler=s.scaler,
        mark=probe.marker(len(batches)),
        average=average,
    )


def _reference_pass(s: Session, batches: Sequence[Any]) -> None:
    """DPO under pp: the reference's log-probs first ([Note: preference pairs through
    pipeline stages])."""
    loss = s.trainable.loss_fn
    if isinstance(loss, DpoLoss) and s.trainable.pipeline is not None:
        reference_pass(s.trainable.pipeline, loss, batches)


def run_step(s: Session, probe: HangProbe) -> StepOutcome:
    """One step on the next batches. The scheduler steps too, so read the step's LR
    before calling this."""
    if s.rl is not None:
        return grpo_step(s, s.rl, probe)
    with record_function(DATA_NAME):  # the profiler's "data" category
        batches = [b.to(s.device, non_blocking=True) for b in s.loader.next_step()]
    if s.trainable.pipeline is not None:  # [Note: the pipelined step]
        _reference_pass(s, batches)
        result = pipeline_step(
            s.trainable.pipeline,
            s.trainable.model,
            s.trainable.optimizer,
            batches,
            max_norm=s.cfg.train.grad_clip,
        )
        s.scheduler.step()
        extra: dict[str, float] = {}
        dpo = getattr(s.trainable.loss_fn, "step_metrics", None)  # DPO's rewards (collective)
        if dpo is not None:
            extra |= dpo()
        routing = s.trainable.pipeline.routing  # a mixture-of-experts model's router loss
        if routing is not None:
            extra |= routing.step_metrics()
        return StepOutcome(_global_mean(result.loss), float(result.grad_norm), extra)
    result = _train(s, batches, probe=probe)
    s.scheduler.step()
    # DPO's rewards (collective), MoE's router
    metrics = getattr(s.trainable.loss_fn, "step_metrics", None)
    extra = metrics() if metrics is not None else {}
    return StepOutcome(_global_mean(result.loss), float(result.grad_norm), extra)


def grpo_step(s: Session, rl: RlRun, probe: HangProbe) -> StepOutcome:
    """[Note: the GRPO step]."""
    cfg, model, step = s.cfg, s.trainable.model, s.state.step + 1
    g = cfg.rl.num_generations
    with record_function(DATA_NAME):
        prompts = s.loader.next_step()
    rollout = sample(rl, cfg, prompts, step=step)
    totals = gather_rewards(rollout.scores.total)
    advantages = group_advantages(totals, group_size=g, scale=cfg.rl.scale_rewards).advantages
    start = prompts.start * g
    local = advantages[start : start + len(rollout.completions)]
    batches = micro_batches(rollout, local, cfg=cfg, split=s.split, device=s.device)
    old = recompute(model, batches, temperature=cfg.rl.temperature)
    gap = logprob_gap([b.engine_logps for b in batches], old, [b.sampled for b in batches])
    check_gap(
        gap,
        limit=rl.gap_limit,
        step=step,
        engine=rl.engine.name,
        checkpoint_note=newest_checkpoint_note(s.run_dir),
    )
    refs = (
        reference_logps(rl, model, batches, temperature=cfg.rl.temperature)
        if cfg.rl.beta > 0
        else [None] * len(batches)
    )
    batches = [b.with_logps(old=o, ref=r) for b, o, r in zip(batches, old, refs)]
    sequences, tokens = global_counts(batches, device=s.device)
    loss_fn = GrpoLoss(
        cfg,
        denominator=loss_denominator(
            loss_type=cfg.rl.loss_type,
            num_sequences=sequences,
            num_tokens=tokens,
            max_completion_length=cfg.rl.max_completion_length,
        ),
        dp=dist.get_world_size() if dist.is_initialized() else 1,
        off_policy=cfg.rl.num_iterations > 1,
    )
    for _ in range(cfg.rl.num_iterations):
        result = _train(s, batches, probe=probe, loss_fn=loss_fn, average=False)
    rl.engine.weights_updated()  # the next rollout's engine needs these weights
    s.scheduler.step()
    metrics = rollout_metrics(rollout, totals, gap, g=g) | sync_metrics(cfg, rollout.sync)
    metrics |= {f"rl/{k}": v for k, v in summed_metrics(loss_fn.metrics).items()}
    trained = sum(int(b.inputs.numel()) for b in batches) * cfg.rl.num_iterations
    return StepOutcome(
        _global_mean(result.loss),
        float(result.grad_norm),
        metrics,
        tokens=int(_global_mean(torch.tensor(float(trained), device=s.device)) * s.env.world_size),
    )


@torch.no_grad()
def evaluate(s: Session) -> dict[str, float] | None:
    """The held-out metrics (collective): the mean validation loss over every rank's
    fixed validation batches (``val_loss``), or GRPO's held-out prompts, one completion
    each, scored (``val_reward``, ``val_pass_rate``); None without held-out data."""
    if not s.val:
        return None
    if s.rl is not None:
        return held_out(s.rl, s.cfg, s.val[0])
    if s.trainable.pipeline is not None:
        batches = [t.to(s.device) for t in s.val]
        _reference_pass(s, batches)
        val = pipeline_eval(s.trainable.pipeline, batches)
        return {"val_loss": _global_mean(val)}
    s.trainable.model.eval()
    total = torch.zeros((), device=s.device)
    for tokens in s.val:
        total += s.trainable.loss_fn(s.trainable.model, tokens.to(s.device)).float()
    s.trainable.model.train()
    return {"val_loss": _global_mean(total / len(s.val))}
