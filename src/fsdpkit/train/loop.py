"""The training loop of one rank: steps, evaluation, metrics, checkpoints, summary.

``run(session)`` drives a built ``Session`` (fsdpkit.train.session) to
``train.steps``; each step is ``fsdpkit.trainable.step.train_step`` (the function the
planner traces). The logged loss is the mean over all data-parallel ranks. Rank 0
claims the run directory (checks, lock, ``config.toml``), writes metrics and shows
progress. SIGTERM, SIGINT and SIGHUP stop the run at a step boundary with a
checkpoint ([Note: agreeing to stop]). The loop runs the same under the CLI's
workers and under ``fsdpkit.testing.run_ranks`` in a test.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from fsdpkit.checkpoint import step_dir_name
from fsdpkit.errors import UserError
from fsdpkit.observe.observer import Observer
from fsdpkit.runtime.failures import newest_checkpoint_note
from fsdpkit.runtime.hangs import HangProbe
from fsdpkit.runtime.rundir import RunDirError, check_run_dir
from fsdpkit.runtime.runlock import RunLock, acquire
from fsdpkit.runtime.signals import StopFlag, agreed_signal, describe_stop, install_stop_flag
from fsdpkit.sharding.compile import compile_seconds
from fsdpkit.sharding.context.attention import local_attention
from fsdpkit.train.generate import sample
from fsdpkit.train.guards import check_finite
from fsdpkit.train.progress import Progress
from fsdpkit.train.session import Session, write_run_dir
from fsdpkit.train.stepping import StepOutcome, evaluate, run_step
from fsdpkit.train.summary import RunSummary
from fsdpkit.train.telemetry import device_peak_flops, peak_memory_kind, peak_memory_mib

log = logging.getLogger(__name__)


class StepError(RuntimeError):
    """A step failed (collective timeout, a peer died...); says at which step."""


def _compile_share(s: Session, seconds: float) -> float:
    """The longest compile of any rank in this step: the others wait for it at their
    next collective, so it is what the step's wall time holds ([Note: compile time])."""
    if not s.cfg.train.compile:
        return 0.0
    value = torch.tensor([seconds], device=s.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _record(
    s: Session, *, step: int, outcome: StepOutcome, lr: float, dt: float, compile_s: float
) -> dict[str, Any]:
    """One metrics record; tokens/s over the step time without compilation."""
    cfg = s.cfg
    rows = s.split.global_batch * (2 if cfg.train.objective == "dpo" else 1)  # DPO: 2 per pair
    tokens = outcome.tokens if outcome.tokens is not None else rows * cfg.data.seq_len
    tokens_per_s = tokens / max(dt - compile_s, 1e-9)
    peak = device_peak_flops(
        device_type=s.env.device_type, low_precision=s.trainable.precision.low_precision
    )
    mfu = None
    if peak and s.trainable.llama is not None:
        flops = s.trainable.model.flops_per_token(cfg.data.seq_len)  # type: ignore[operator]
        mfu = flops * tokens_per_s / s.env.world_size / peak
    mem = torch.tensor([peak_memory_mib(s.env.device_type)], device=s.device)
    mems = [torch.zeros(1, device=s.device) for _ in range(s.env.world_size)]
    dist.all_gather(mems, mem)
    return {
        "step": step,
        "loss": outcome.loss,
        "lr": lr,
        "grad_norm": outcome.grad_norm,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "peak_mem_mib": [round(float(m), 1) for m in mems],
        "peak_mem_kind": peak_memory_kind(s.env.device_type),
        "step_time_s": dt,
        "compile_s": compile_s,
        "checkpoint_in_flight": bool(s.checkpointer and s.checkpointer.in_flight),
    }


def _maybe_eval(
    s: Session, *, step: int, progress: Progress, summary: RunSummary, obs: Observer
) -> None:
    every = s.cfg.train.eval_every
    if every and (step % every == 0 or step == s.cfg.train.steps):
        values = evaluate(s)
        if values is None:
            return
        _write_metrics(s, {"step": step, **values})
        val = values.get("val_loss")
        if val is not None:
            summary.val_losses.append(val)
            progress.message(f"step {step}: validation loss {val:.4f}")
            obs.on_eval(step, val)
        else:  # GRPO's held-out rewards, to the sinks as val/*
            shown = ", ".join(f"{k} {v:.4f}" for k, v in values.items())
            progress.message(f"step {step}: held out: {shown}")
            obs.on_step({"step": step, **values})


def _maybe_checkpoint(s: Session, *, step: int, progress: Progress, obs: Observer) -> None:
    if s.checkpointer is None:
        return
    if s.checkpointer.maybe_save(step, s.app_state(), final=step == s.cfg.train.steps):
        blocking = s.checkpointer.last_blocking_s
        _write_metrics(s, {"step": step, "checkpoint_blocking_s": blocking})
        obs.on_checkpoint(step, blocking)
        progress.message(f"step {step}: checkpoint saved ({blocking:.2f}s blocking)")


def _write_metrics(s: Session, record: dict[str, Any]) -> None:
    """Append to metrics.jsonl (rank 0); a file-system fault names the newest
    checkpoint so the user knows what a rerun resumes from."""
    try:
        s.metrics.write(record)
    except RunDirError as exc:
        raise RunDirError(
            f"{exc} Training stopped after step {s.state.step}. {newest_checkpoint_note(s.run_dir)}"
        ) from None


def _stop_for_signal(s: Session, *, signum: int, step: int) -> str:
    """Save (or not) after a stop signal; what happened, for the user."""
    what = describe_stop(signum)
    ckpt = s.checkpointer
    if ckpt is None:
        return (
            f"{what}: stopped after step {step}; no checkpoint saved: checkpointing is off "
            "(checkpoint.every = 0 and checkpoint.resume = never)."
        )
    if not s.cfg.checkpoint.save_on_sigterm:
        return (
            f"{what}: stopped after step {step}; no checkpoint saved "
            f"(checkpoint.save_on_sigterm = false). {newest_checkpoint_note(s.run_dir)}"
        )
    if step == 0:
        return f"{what}: stopped before the first step; nothing to save."
    if ckpt.last_step != step:
        ckpt.save(step, s.app_state(), blocking=True)
    ckpt.wait()
    return (
        f"{what}: checkpointed step {step} ({ckpt.root / step_dir_name(step)}); run the "
        "same command again to resume from it."
    )


def _stop_requested(s: Session, stop: StopFlag, summary: RunSummary, progress: Progress) -> bool:
    """Collective ([Note: agreeing to stop]): whether any rank got a stop signal; if so
    every rank saves the current step and ``summary`` records what happened."""
    signum = agreed_signal(stop.signum, device=s.device)
    if not signum:
        return False
    summary.stop_signal = signum
    summary.stop_note = _stop_for_signal(s, signum=signum, step=s.state.step)
    progress.message(summary.stop_note)
    return True


def _run_steps(
    s: Session,
    *,
    progress: Progress,
    summary: RunSummary,
    stop: StopFlag,
    obs: Observer,
    probe: HangProbe,
) -> None:
    cfg = s.cfg
    rates = []
    while s.state.step < cfg.train.steps:
        probe.phase("data")  # [Note: progress record]: the stop agreement, then batches
        if _stop_requested(s, stop, summary, progress):
            break
        obs.before_step(s.state.step + 1)
        t0, c0 = time.perf_counter(), compile_seconds()
        lr = float(s.scheduler.get_last_lr()[0])
        try:
            outcome = run_step(s, probe)
        except UserError:  # e.g. a model output without logits: the message says what to do
            raise
        except Exception as exc:
            raise StepError(f"step {s.state.step + 1} failed: {type(exc).__name__}: {exc}") from exc
        s.state.step += 1
        step = s.state.step
        probe.step_done(step)
        loss = outcome.loss
        check_finite(
            loss=loss,
            grad_norm=outcome.grad_norm,
            step=step,
            scaled=bool(s.scaler),
            checkpointer=s.checkpointer,
        )
        dt = time.perf_counter() - t0
        compile_s = _compile_share(s, compile_seconds() - c0)
        summary.compile_s += compile_s
        if note := obs.after_step(step, step_time_s=dt):
            progress.message(note)
        if step % cfg.logging.log_every == 0 or step == cfg.train.steps:
            record = _record(s, step=step, outcome=outcome, lr=lr, dt=dt, compile_s=compile_s)
            record |= outcome.metrics
            _write_metrics(s, record)
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
        probe.phase("eval")
        _maybe_eval(s, step=step, progress=progress, summary=summary, obs=obs)
        probe.phase("checkpoint")
        _maybe_checkpoint(s, step=step, progress=progress, obs=obs)
    steady = rates[1:] or rates
    summary.tokens_per_s = sum(steady) / len(steady) if steady else 0.0
    summary.steps = s.state.step


def _broadcast_error(s: Session, message: str | None) -> str | None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def claim_run_dir(s: Session) -> RunLock | None:
    """Rank 0 checks the run dir, takes its lock unless the launcher holds it
    ([Note: run-dir lock]) and writes ``config.toml`` (``write_run_dir``); collective:
    every rank raises the same error, or none."""
    lock, error = None, None
    if s.env.rank == 0:
        try:
            check_run_dir(s.run_dir)
            if not s.env.run_dir_locked:
                lock = acquire(s.run_dir)
            write_run_dir(s)
        except UserError as exc:
            if lock is not None:
                lock.release()
            error = f"{exc}"
    error = _broadcast_error(s, error)
    if error is not None:
        raise RunDirError(error)
    return lock


def reapply_schedule(s: Session) -> None:
    """Set the LR THIS config's schedule gives the next step: a resumed checkpoint
    holds the optimizer's LR (and base LR) of the old config, so a changed train.steps,
    train.lr, warm-up or schedule would otherwise apply one step late. Bit-identical to
    the saved LR when nothing changed (the same expression on the same numbers)."""
    sched = s.scheduler
    sched.base_lrs = [s.cfg.train.lr for _ in s.trainable.optimizer.param_groups]
    lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, lr in zip(s.trainable.optimizer.param_groups, lrs):
        group["initial_lr"] = s.cfg.train.lr
        group["lr"] = lr
    sched._last_lr = lrs  # what get_last_lr() reports


def run(
    s: Session,
    *,
    obs: Observer | None = None,
    stop: StopFlag | None = None,
    probe: HangProbe | None = None,
) -> RunSummary:
    """Train ``s`` to ``train.steps`` (collective: every rank runs it), resuming from
    a checkpoint when one is configured. ``obs``: made before the session to count CPU
    tensor memory for the profiler (fsdpkit.observe.observer); made here otherwise.
    ``stop``: a stop-signal flag installed earlier (the worker installs one before
    building the session); installed here otherwise. ``probe``: the rank's hang-triage
    probe (fsdpkit.runtime.hangs; the worker starts one); none here otherwise."""
    stop = stop if stop is not None else install_stop_flag()
    probe = probe or HangProbe.off()
    lock = claim_run_dir(s)
    try:
        obs = obs or Observer(s.cfg, s.env, cpu_memory=False)
        return _train(s, obs=obs, stop=stop, probe=probe)
    finally:
        if s.rl is not None:
            s.rl.engine.close()  # a vLLM engine process ends with the run
        if lock is not None:
            lock.release()


def _train(s: Session, *, obs: Observer, stop: StopFlag, probe: HangProbe) -> RunSummary:
    cfg, env = s.cfg, s.env
    obs.start()
    resumed = s.checkpointer.resume(s.app_state()) if s.checkpointer else None
    if resumed is not None:
        reapply_schedule(s)
        probe.resumed(resumed)
    s.metrics.start(resumed_step=resumed or 0)
    if s.data_record:
        _write_metrics(s, {"step": s.state.step, "data": s.data_record})
    progress = Progress(
        total=cfg.train.steps, start=s.state.step, mode=cfg.logging.progress, enabled=env.rank == 0
    )
    progress.message(
        f"fsdpkit: {env.world_size} ranks ({env.device_type}), {s.trainable.plan.describe()}; "
        f"{s.split.global_batch} {'pairs' if cfg.train.objective == 'dpo' else 'sequences'} "
        f"per step ({s.split.grad_accum} x {s.split.micro_batch} per rank)"
    )
    pipe = s.trainable.pipeline.describe() if s.trainable.pipeline is not None else None
    for note in (
        pipe,
        s.trainable.finetune.describe() if s.trainable.finetune else None,
        s.data_note,
        s.trainable.loss_note,
    ):
        if note:
            progress.message(note)
    if resumed is not None:
        progress.message(f"resumed from step {resumed}")
    summary = RunSummary(
        params=s.trainable.finetune.counts.describe() if s.trainable.finetune else None
    )
    _run_steps(s, progress=progress, summary=summary, stop=stop, obs=obs, probe=probe)
    probe.phase("finish")
    if s.checkpointer is not None:
        s.checkpointer.wait()
    if note := obs.close():
        progress.message(note)
    progress.close()
    if s.trainable.pipeline is not None and cfg.train.sample_tokens:
        progress.message("train.sample_tokens: no sample under parallel.pp (not supported)")
    elif (
        s.trainable.llama is not None
        and s.rl is None  # a GRPO run samples its own completions every step
        and cfg.train.sample_tokens
        and s.state.step == cfg.train.steps
    ):
        # every cp rank runs the same whole window: no sequence exchange
        local = (
            local_attention(s.trainable.model) if cfg.parallel.cp > 1 else contextlib.nullcontext()
        )
        with local:
            summary.sample_text = sample(
                s.trainable.model,
                s.tokenizer,
                prompt="def ",
                max_new_tokens=cfg.train.sample_tokens,
                context=cfg.data.seq_len,
                device=s.device,
                seed=cfg.train.seed,
                multiple_of=cfg.parallel.tp,
            )
    return summary
