"""``plan()``: the planner's entry point — memory, traffic and a fit verdict."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from fsdpkit.config import RunConfig
from fsdpkit.config.rl_rules import with_rl_context
from fsdpkit.config.schedules import SCHEDULES
from fsdpkit.data import host_bytes
from fsdpkit.devices import DEFAULT_MARGIN, Device, usable_bytes
from fsdpkit.planner.errors import PlanError
from fsdpkit.planner.experts.routing import BALANCED, Routing
from fsdpkit.planner.model.finetune_layout import finetuned
from fsdpkit.planner.model.grpo_terms import TRACED_GRPO
from fsdpkit.planner.replay.analytic import analytic_memory
from fsdpkit.planner.replay.comm import comm_volume
from fsdpkit.planner.replay.grpohead import grpo_loss_peak
from fsdpkit.planner.replay.headmem import loss_buffer_peak
from fsdpkit.planner.replay.rolloutmem import with_rollout
from fsdpkit.planner.replay.sizing import head_sizes
from fsdpkit.planner.shapes.result import LossBuffers, MemoryPlan, Plan
from fsdpkit.planner.shapes.scenario import Scenario, scenario


def decide_accum_sync(sc: Scenario, *, usable: int | None) -> Scenario:
    """[Note: accum_sync auto]
    ``parallel.accum_sync = auto`` is ``last`` (the least traffic) when its planned
    peak fits ``usable`` bytes, else ``every`` (no unsharded gradients between
    micro-batches). Without a memory budget, without accumulation or without sharding
    (nothing to choose) it is ``last``. The analytic plan decides (milliseconds), so
    the launcher and every worker agree; ``fsdpkit.planner.search.auto.accum_sync_choice``
    applies the same rule to a run."""
    if not sc.accum_auto:
        return sc
    last = sc.with_(accum_auto=False, accum_sync="last")
    if sc.dims.pp > 1:  # torch's schedules accumulate without sync ([Note: FSDP inside a stage])
        return last
    formulas = sc.analytic_why_not is None and sc.model is not None
    if usable is None or sc.grad_accum == 1 or sc.dims.fsdp_shard == 1 or not formulas:
        return last
    peak = analytic_memory(last).peak.bytes
    if peak <= usable:
        return last
    note = (
        f"parallel.accum_sync = auto planned as every: last (no-sync accumulation) "
        f"needs {_size(peak)} > {_size(usable)} usable"
    )
    return sc.with_(accum_auto=False, accum_sync="every", notes=(*sc.notes, note))


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def plan_scenario(
    sc: Scenario,
    *,
    cfg: RunConfig | None = None,
    trace: bool | None = None,
    margin: float,
    shallow: bool = False,
) -> Plan:
    """Plan an already resolved scenario. ``trace``: True runs the traced planner,
    False the analytic one (PlanError for a model it cannot replay), None the analytic
    one where it applies and the traced one otherwise. ``cfg`` is needed to trace.
    ``shallow``: a deep built-in model is traced at a few blocks and extrapolated where
    that is exact ([Note: depth extrapolation]; the recommender's search)."""
    if not 0.0 <= margin < 1.0:
        raise PlanError(f"--margin must be in [0, 1), got {margin}.")
    start = time.perf_counter()
    usable = usable_bytes(sc.device, margin=margin)
    sc = decide_accum_sync(sc, usable=usable)
    other: MemoryPlan | None = None
    analytic = sc.analytic_why_not is None and sc.model is not None
    if sc.dims.pp > 1:  # [Note: pipeline plans]
        return _pipeline(sc, cfg=cfg, trace=trace, usable=usable, margin=margin, start=start)
    if trace is None and not analytic:  # [Note: planning any model]: trace the rest
        trace = True
        sc = sc.with_(notes=(*sc.notes, f"planned by tracing: {sc.analytic_why_not}"))
    if trace:
        if cfg is None:
            raise PlanError("traced planning needs the RunConfig (pass cfg=...)")
        from fsdpkit.planner.traced.depth import extrapolated_memory, extrapolates
        from fsdpkit.planner.traced.trace import traced_memory  # imports torch's fake machinery

        if sc.grpo is not None:  # the language-model step at GRPO's rows (prompt + completion)
            cfg = replace(cfg, data=replace(cfg.data, seq_len=sc.seq_len))
        deep = shallow and extrapolates(cfg, sc)
        memory = extrapolated_memory(cfg, sc) if deep else traced_memory(cfg, sc)
        if sc.grpo is not None:
            memory = replace(memory, notes=(*memory.notes, TRACED_GRPO))
        other = analytic_memory(sc) if analytic else None
    else:
        memory = analytic_memory(sc)
    if sc.async_checkpoint:  # staging imports DTensor (~0.5 s), which a plan otherwise skips
        from fsdpkit.checkpoint.staging import async_staging_bytes

        memory = replace(memory, staging_bytes=async_staging_bytes(memory.model_states))
    grpo = None
    if sc.grpo is not None:  # the rollout phase beside the training step's
        memory, grpo = with_rollout(sc, memory)
    return Plan(
        scenario=sc,
        memory=memory,
        comm=comm_volume(sc),
        device_bytes=sc.device.memory,
        usable_bytes=usable,
        margin=margin,
        fits=None if usable is None else memory.peak.bytes <= usable,
        elapsed_s=time.perf_counter() - start,
        other=other,
        loss=loss_buffers(sc) if analytic else None,
        data_host_bytes=_data_host_bytes(cfg, sc),
        grpo=grpo,
    )


def _pipeline(
    sc: Scenario,
    *,
    cfg: RunConfig | None,
    trace: bool | None,
    usable: int | None,
    margin: float,
    start: float,
) -> Plan:
    """A pipelined run's plan: the pipeline rank with the highest peak (every rank must
    fit), every rank's figures in ``Plan.pipeline``."""
    from fsdpkit.planner.pipeline.plan import pipeline_plan

    if cfg is None:
        raise PlanError("a pipelined plan needs the RunConfig (pass cfg=...)")
    if trace is False and sc.analytic_why_not is not None:
        raise PlanError(
            f"parallel.pp: this pipelined run has no analytic plan ({sc.analytic_why_not}); "
            "plan it traced (the default for such a model)."
        )
    if trace and sc.analytic_why_not is None:
        sc = sc.with_(analytic_why_not="a traced plan was asked for")
    if sc.analytic_why_not is not None:  # [Note: traced pipeline plans]
        _require_traceable_pipeline(cfg, sc)
        sc = sc.with_(
            notes=(*sc.notes, f"planned by tracing each pipeline rank: {sc.analytic_why_not}")
        )
    pipe = pipeline_plan(cfg, sc)
    worst = pipe.worst
    memory = worst.memory
    if unchecked_finetune(cfg):
        memory = replace(memory, notes=(*memory.notes, PIPELINE_FINETUNE_NOTE))
    return Plan(
        scenario=sc,
        memory=memory,
        comm=worst.comm,
        device_bytes=sc.device.memory,
        usable_bytes=usable,
        margin=margin,
        fits=None if usable is None else worst.memory.peak.bytes <= usable,
        elapsed_s=time.perf_counter() - start,
        data_host_bytes=_data_host_bytes(cfg, sc),
        pipeline=pipe,
    )


def _require_traceable_pipeline(cfg: RunConfig, sc: Scenario) -> None:
    """A pipelined run the analytic model cannot replay is traced rank by rank: its
    language-model step under a schedule the trace can run."""
    from fsdpkit.planner.pipeline.traced import traceable

    why = traceable(cfg.parallel.pp_schedule)
    if why is None and (sc.reference_bytes or sc.grpo is not None):
        why = "the traced pipeline plan runs the language-model step, not DPO's or GRPO's"
    if why is not None:
        raise PlanError(
            f"parallel.pp: this pipelined run is planned by tracing each pipeline rank "
            f"({sc.analytic_why_not}), which it cannot be: {why}. Plan it with "
            "parallel.pp_schedule = 1F1B (or GPipe, Interleaved1F1B) for its stages' "
            "memory, or measure a few real steps."
        )


PIPELINE_FINETUNE_NOTE = (
    "fine-tuning under a zero-bubble pipeline schedule: this stage plan is not checked "
    "within 1% of real steps (a tiny Llama's LoRA stages read up to 1.7% below their "
    "true peak: docs/planner.md, bench/plan_pipeline_finetune.py); leave a few % headroom"
)
"""Said in the plan of a pipelined run that ``unchecked_finetune`` names (LoRA and
``model.freeze`` under 1F1B and GPipe are within 0.1% of every rank's true peak: the
bench's other rows)."""


def unchecked_finetune(cfg: RunConfig) -> bool:
    """A pipelined fine-tuning run whose stage plans are not within 1% of real steps:
    a zero-bubble schedule's (what torch's input pass keeps for the adapters' weight
    passes is not all modelled)."""
    return finetuned(cfg) and SCHEDULES[cfg.parallel.pp_schedule].zero_bubble


def _data_host_bytes(cfg: RunConfig | None, sc: Scenario) -> int:
    """The data path's host memory per rank (prepared shards are mapped, not loaded)."""
    if cfg is None:
        return 0
    work_dir = Path(cfg.logging.run_dir)
    return host_bytes(cfg.data, micro_batch=sc.micro_batch, work_dir=work_dir)


def loss_buffers(sc: Scenario) -> LossBuffers:
    """Logits and loss buffers of ``sc``'s loss mode, and of full logits (a model the
    analytic planner knows: the vocabulary and hidden size come from its shape)."""
    s = head_sizes(sc)
    if sc.grpo is not None:  # [Note: GRPO loss head memory]
        peak = grpo_loss_peak(s, sc.grpo, rows=sc.micro_batch)
        return LossBuffers(chunk=None, chosen=peak, full=peak)
    chosen = loss_buffer_peak(s, chunk=sc.loss_chunk)
    full = loss_buffer_peak(s, chunk=None) if sc.loss_chunk is not None else chosen
    return LossBuffers(chunk=sc.loss_chunk, chosen=chosen, full=full)


def plan(
    cfg: RunConfig,
    *,
    world_size: int,
    device: Device | None = None,
    trace: bool | None = None,
    margin: float = DEFAULT_MARGIN,
    ranks_per_node: int = 8,
    vocab_size: int | None = None,
    routing: Routing = BALANCED,
) -> Plan:
    """Per-rank memory and traffic of training ``cfg`` on ``world_size`` ranks.

    ``device`` (see ``devices.parse_device``) gives the memory to fit in and how
    ``precision.mode = auto`` resolves; ``trace`` runs the real model code on a fake
    process group instead of the formulas (seconds to minutes, no devices needed;
    None: only for a model the formulas do not cover, False: formulas or PlanError);
    ``vocab_size`` is the tokenizer's when the config leaves model.vocab_size empty;
    ``routing``: the routing a MoE model's trace assumes under ep ([Note: routing in
    the plan]; default balanced).
    """
    cfg = with_rl_context(cfg)  # GRPO's rows: prompt + completion, as the trainer reads them
    sc = scenario(
        cfg,
        world_size=world_size,
        device=device,
        ranks_per_node=ranks_per_node,
        vocab_size=vocab_size,
        routing=routing,
    )
    return plan_scenario(sc, cfg=cfg, trace=trace, margin=margin)
