"""The training loop of one rank: steps, evaluation, metrics, checkpoints, summary.

``run(session)`` drives a built ``Session`` (fsdpkit.train.session) to
``train.steps``; each step is ``fsdpkit.train.step.train_step`` (the function the
planner traces). The logged loss is the mean over all data-parallel ranks. Rank 0
writes metrics and shows progress. The loop runs the same under the CLI's workers
and under ``fsdpkit.testing.run_ranks`` in a test.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from fsdpkit.checkpoint import any_rank
from fsdpkit.errors import UserError
from fsdpkit.observe.breakdown import DATA_NAME
from fsdpkit.observe.observer import Observer
from fsdpkit.train.generate import sample
from fsdpkit.train.guards import check_finite
from fsdpkit.train.progress import Progress
from fsdpkit.train.session import Session, write_run_dir
from fsdpkit.train.step import train_step
from fsdpkit.train.summary import RunSummary
from fsdpkit.train.telemetry import device_peak_flops, peak_memory_kind, peak_memory_mib

log = logging.getLogger(__name__)


class StepError(RuntimeError):
    """A step failed (collective timeout, a peer died...); says at which step."""


def _global_mean(value: torch.Tensor) -> float:
    if dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return float(value)


def _step(s: Session) -> tuple[float, float]:
    """One optimizer step on the next micro-batches; (mean loss over ranks, grad norm).
    The scheduler steps too, so read the step's LR before calling this."""
    with record_function(DATA_NAME):  # the profiler's "data" category
        batches = [
            s.loader.next_batch().to(s.device, non_blocking=True)
            for _ in range(s.cfg.train.grad_accum)
        ]
    result = train_step(
        s.model,
        s.optimizer,
        batches,
        loss_fn=s.loss_fn,
        max_norm=s.cfg.train.grad_clip,
        keep_unsharded=s.cfg.parallel.accum_keep_unsharded,
        scaler=s.scaler,
    )
    s.scheduler.step()
    return _global_mean(result.loss), float(result.grad_norm)


@torch.no_grad()
def evaluate(s: Session) -> float | None:
    """Mean validation loss over the fixed validation batches of every rank."""
    if not s.val:
        return None
    s.model.eval()
    total = torch.zeros((), device=s.device)
    for tokens in s.val:
        total += s.loss_fn(s.model, tokens.to(s.device)).float()
    s.model.train()
    return _global_mean(total / len(s.val))


def _record(
    s: Session, *, step: int, loss: float, norm: float, lr: float, dt: float
) -> dict[str, Any]:
    cfg = s.cfg
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len * cfg.train.grad_accum
    tokens_per_s = tokens * s.env.world_size / dt
    peak = device_peak_flops(device_type=s.env.device_type, low_precision=s.precision.low_precision)
    mfu = None
    if peak and s.llama is not None:
        flops = s.model.flops_per_token(cfg.data.seq_len)  # type: ignore[operator]
        mfu = flops * tokens_per_s / s.env.world_size / peak
    mem = torch.tensor([peak_memory_mib(s.env.device_type)], device=s.device)
    mems = [torch.zeros(1, device=s.device) for _ in range(s.env.world_size)]
    dist.all_gather(mems, mem)
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": norm,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "peak_mem_mib": [round(float(m), 1) for m in mems],
        "peak_mem_kind": peak_memory_kind(s.env.device_type),
        "step_time_s": dt,
        "checkpoint_in_flight": bool(s.checkpointer and s.checkpointer.in_flight),
    }


def _maybe_eval(
    s: Session, *, step: int, progress: Progress, summary: RunSummary, obs: Observer
) -> None:
    every = s.cfg.train.eval_every
    if every and (step % every == 0 or step == s.cfg.train.steps):
        val = evaluate(s)
        if val is not None:
            summary.val_losses.append(val)
            progress.message(f"step {step}: validation loss {val:.4f}")
            s.metrics.write({"step": step, "val_loss": val})
            obs.on_eval(step, val)


def _maybe_checkpoint(s: Session, *, step: int, progress: Progress, obs: Observer) -> None:
    if s.checkpointer is None:
        return
    if s.checkpointer.maybe_save(step, s.app_state(), final=step == s.cfg.train.steps):
        blocking = s.checkpointer.last_blocking_s
        s.metrics.write({"step": step, "checkpoint_blocking_s": blocking})
        obs.on_checkpoint(step, blocking)
        progress.message(f"step {step}: checkpoint saved ({blocking:.2f}s blocking)")


def _run_steps(
    s: Session, *, progress: Progress, summary: RunSummary, stop_flag: Any, obs: Observer
) -> None:
    cfg = s.cfg
    rates = []
    while s.state.step < cfg.train.steps:
        obs.before_step(s.state.step + 1)
        t0 = time.perf_counter()
        lr = float(s.scheduler.get_last_lr()[0])
        try:
            loss, norm = _step(s)
        except UserError:  # e.g. a model output without logits: the message says what to do
            raise
        except Exception as exc:
            raise StepError(f"step {s.state.step + 1} failed: {type(exc).__name__}: {exc}") from exc
        s.state.step += 1
        step = s.state.step
        check_finite(
            loss=loss, grad_norm=norm, step=step, scaled=bool(s.scaler), checkpointer=s.checkpointer
        )
        dt = time.perf_counter() - t0
        if note := obs.after_step(step, step_time_s=dt):
            progress.message(note)
        if step % cfg.logging.log_every == 0 or step == cfg.train.steps:
            record = _record(s, step=step, loss=loss, norm=norm, lr=lr, dt=dt)
            s.metrics.write(record)
            obs.on_step(record)
            rates.append(record["tokens_per_s"])
            summary.peak_mem_mib = max(record["peak_mem_mib"])
            progress.update(
                step=step,
                loss=loss,
                tokens_per_s=record["tokens_per_s"],
                mem_mib=record["peak_mem_mib"],
            )
        summary.final_loss = loss
        _maybe_eval(s, step=step, progress=progress, summary=summary, obs=obs)
        _maybe_checkpoint(s, step=step, progress=progress, obs=obs)
        if stop_flag is not None and any_rank(stop_flag(), device=s.device):
            assert s.checkpointer is not None  # the flag is only installed with one
            if s.checkpointer.last_step != step:
                s.checkpointer.save(step, s.app_state(), blocking=True)
            progress.message(f"SIGTERM: checkpointed step {step}, exiting")
            break
    steady = rates[1:] or rates
    summary.tokens_per_s = sum(steady) / len(steady) if steady else 0.0
    summary.steps = s.state.step


def run(s: Session, *, obs: Observer | None = None) -> RunSummary:
    """Train ``s`` to ``train.steps`` (collective: every rank runs it), resuming from
    a checkpoint when one is configured. ``obs``: made before the session to count CPU
    tensor memory for the profiler (fsdpkit.observe.observer); made here otherwise."""
    cfg, env = s.cfg, s.env
    obs = obs or Observer(cfg, env, cpu_memory=False)
    write_run_dir(s)
    obs.start()
    resumed = s.checkpointer.resume(s.app_state()) if s.checkpointer else None
    s.metrics.start(resumed_step=resumed or 0)
    progress = Progress(
        total=cfg.train.steps, start=s.state.step, mode=cfg.logging.progress, enabled=env.rank == 0
    )
    progress.message(f"fsdpkit: {env.world_size} ranks ({env.device_type}), {s.plan.describe()}")
    for note in (s.finetune.describe() if s.finetune else None, s.data_note):
        if note:
            progress.message(note)
    if resumed is not None:
        progress.message(f"resumed from step {resumed}")
    summary = RunSummary(params=s.finetune.counts.describe() if s.finetune else None)
    stop_flag = None
    if s.checkpointer is not None and cfg.checkpoint.save_on_sigterm:
        from fsdpkit.checkpoint import install_sigterm_flag

        stop_flag = install_sigterm_flag()
    _run_steps(s, progress=progress, summary=summary, stop_flag=stop_flag, obs=obs)
    if s.checkpointer is not None:
        s.checkpointer.wait()
    if note := obs.close():
        progress.message(note)
    progress.close()
    if s.llama is not None and cfg.train.sample_tokens and s.state.step == cfg.train.steps:
        summary.sample_text = sample(
            s.model,
            s.tokenizer,
            prompt="def ",
            max_new_tokens=cfg.train.sample_tokens,
            context=cfg.data.seq_len,
            device=s.device,
            seed=cfg.train.seed,
        )
    return summary
