"""What each of torch's pipelining schedules asks of a run: how many stages a rank
holds, how stages map onto ranks, and how many micro-batches a step must have. Data
only (no torch import): the config checks, the stage split, the schedule builder and
the planner all read this one table.

[Note: pipeline schedules]
``parallel.pp`` ranks hold ``stages = pp x stages_per_rank`` consecutive stages of the
model's blocks; a step's accumulation micro-batches ([Note: batch split] in
fsdpkit.config.batch_split) are the schedule's micro-batches, so ``train.global_batch_size``
means the same with and without pp. torch.distributed.pipelining's schedules (2.13):

- ``GPipe``: one stage per rank; all forwards, then all backwards (every micro-batch's
  activations alive at once). Any number of micro-batches.
- ``1F1B``: one stage per rank; after ``pp - rank`` warm-up forwards, one forward and
  one backward alternate, so stage ``r`` holds at most ``pp - r`` micro-batches'
  activations. Needs at least ``pp`` micro-batches (torch refuses fewer).
- ``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``: ``v`` stages per rank,
  stage ``s`` on rank ``s mod pp`` (looped); the bubble shrinks by ``v``. The interleaved
  ones run ``max(1, n // pp)`` rounds and need ``n`` to be a multiple of that; ZeroBubble
  splits each backward into its input and weight halves.
- ``ZBVZeroBubble``, ``DualPipeV``: exactly two stages per rank in a V (rank ``r`` holds
  stages ``r`` and ``2 pp - 1 - r``, so the first and last stage share rank 0); at least
  ``2 pp - 1`` (ZBV) / ``2 pp`` (DualPipeV) micro-batches.

The zero-bubble ones (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) take neither
torch.compile'd blocks nor activation checkpointing: torch runs their backward in two
passes over one autograd graph, and a checkpointed block recomputes for one backward
only (torch 2.13 fails in the weight pass: checked at pp2 with every mode).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpkit.config.schema import RunConfig
from fsdpkit.errors import ConfigError


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule's shape ([Note: pipeline schedules])."""

    looped: bool
    """Several stages per rank (torch's PipelineScheduleMulti)."""
    style: str = "loop"
    """How stages map to ranks: "loop" (stage s on rank s mod pp) or "v"."""
    fixed_stages: int | None = None
    """Stages per rank the schedule requires (None: any, for looped ones)."""
    zero_bubble: bool = False
    """Backward split into input and weight gradients (no torch.compile'd blocks)."""


SCHEDULES: dict[str, ScheduleSpec] = {
    "GPipe": ScheduleSpec(looped=False, fixed_stages=1),
    "1F1B": ScheduleSpec(looped=False, fixed_stages=1),
    "Interleaved1F1B": ScheduleSpec(looped=True),
    "LoopedBFS": ScheduleSpec(looped=True),
    "InterleavedZeroBubble": ScheduleSpec(looped=True, zero_bubble=True),
    "ZBVZeroBubble": ScheduleSpec(looped=True, style="v", fixed_stages=2, zero_bubble=True),
    "DualPipeV": ScheduleSpec(looped=True, style="v", fixed_stages=2, zero_bubble=True),
}
"""Keys equal ``parallel.pp_schedule``'s choices and torch's ``get_schedule_class`` names."""


def stages_per_rank(*, schedule: str, configured: int | None) -> int:
    """Stages each pipeline rank holds: ``parallel.pp_stages_per_rank``, else the
    schedule's own (1 for one-stage schedules, 2 for the others); ConfigError when the
    two disagree."""
    spec = SCHEDULES[schedule]
    default = spec.fixed_stages or 2
    if configured is None:
        return default
    if spec.fixed_stages is not None and configured != spec.fixed_stages:
        raise ConfigError(
            f"parallel.pp_stages_per_rank = {configured}, but parallel.pp_schedule = "
            f"{schedule!r} runs exactly {spec.fixed_stages} stage(s) per rank. Leave "
            "parallel.pp_stages_per_rank empty, or choose a looped schedule "
            "(Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) for more."
        )
    if configured < 1:
        raise ConfigError(f"parallel.pp_stages_per_rank must be >= 1, got {configured}.")
    return configured


def stage_rank(stage: int, *, pp: int, style: str) -> int:
    """The pipeline rank holding ``stage`` (torch's looped or V mapping)."""
    if style == "loop":
        return stage % pp
    lap, offset = divmod(stage, pp)
    return offset if lap % 2 == 0 else pp - 1 - offset


def micro_batch_need(*, schedule: str, pp: int, micro_batches: int) -> str | None:
    """Why ``micro_batches`` per step are too few (or the wrong count) for
    ``schedule`` at ``pp`` ranks; None when they fit ([Note: pipeline schedules])."""
    if schedule == "1F1B" and micro_batches < pp:
        return f"1F1B needs at least pp = {pp} micro-batches per step"
    if schedule == "ZBVZeroBubble" and micro_batches < 2 * pp - 1:
        return f"ZBVZeroBubble needs at least 2 x pp - 1 = {2 * pp - 1} micro-batches per step"
    if schedule == "DualPipeV" and micro_batches < 2 * pp:
        return f"DualPipeV needs at least 2 x pp = {2 * pp} micro-batches per step"
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            return (
                f"{schedule} runs max(1, micro-batches // pp) = {rounds} rounds and needs "
                f"the micro-batches per step to be a multiple of it"
            )
    return None


def _unsupported(cfg: RunConfig) -> list[tuple[str, str]]:
    """(setting, why) for each option a pipelined run does not take."""
    p, t = cfg.parallel, cfg.train
    found = []
    if t.objective == "dpo" and p.cp > 1:
        found.append(("train.objective = dpo with parallel.cp", "not split into stages yet"))
    if t.objective == "grpo":
        found.append(("train.objective = grpo", "rollouts run under data parallelism only"))
    if p.accum_sync == "every":
        found.append(
            ("parallel.accum_sync = every", "each stage reduces its gradients once a step")
        )
    if p.accum_keep_unsharded:
        found.append(
            ("parallel.accum_keep_unsharded = true", "torch's schedule decides the resharding")
        )
    if cfg.precision.mode == "fp16" or cfg.precision.grad_scaler:
        scaled = (
            "precision.mode = fp16" if cfg.precision.mode == "fp16" else "precision.grad_scaler"
        )
        found.append((f"{scaled} (a gradient scaler)", "the schedule runs each stage's backward"))
    zero_bubble = SCHEDULES[p.pp_schedule].zero_bubble
    if t.compile and zero_bubble:
        found.append((f"train.compile with {p.pp_schedule}", "torch splits no compiled backward"))
    if cfg.activations.mode != "none" and zero_bubble:
        found.append(
            (
                f"activations.mode = {cfg.activations.mode} with {p.pp_schedule}",
                "its backward runs twice over one graph (input, then weight gradients), and "
                "torch's checkpoint recomputes a block for one backward only (the weight "
                "pass fails); use 1F1B, Interleaved1F1B or LoopedBFS with checkpointing",
            )
        )
    return found


def validate_pipeline(cfg: RunConfig) -> None:
    """``parallel.pp`` against the rest of the config, before any process starts
    (the world size and the model are checked later: ``check_micro_batches``,
    fsdpkit.sharding.pipeline.split.check_pipeline_layout)."""
    p = cfg.parallel
    if p.pp < 1:
        raise ConfigError(f"parallel.pp must be >= 1, got {p.pp}.")
    if p.pp == 1:
        return
    stages_per_rank(schedule=p.pp_schedule, configured=p.pp_stages_per_rank)
    bad = _unsupported(cfg)
    if bad:
        setting, why = bad[0]
        raise ConfigError(
            f"parallel.pp = {p.pp} cannot be combined with {setting}: {why}. Remove that "
            "setting, or train with parallel.pp = 1 (FSDP, tp and cp without stages)."
        )


def check_micro_batches(cfg: RunConfig, *, dp: int, micro_batches: int) -> None:
    """The step's accumulation micro-batches (at ``dp`` data-parallel ranks) are the
    pipeline schedule's: refuse a count the schedule cannot run."""
    p = cfg.parallel
    if p.pp == 1:
        return
    why = micro_batch_need(schedule=p.pp_schedule, pp=p.pp, micro_batches=micro_batches)
    if why is None:
        return
    t = cfg.train
    given = (
        f"train.global_batch_size = {t.global_batch_size} over {dp} data-parallel ranks"
        if t.global_batch_size is not None
        else f"train.grad_accum = {t.grad_accum}"
    )
    raise ConfigError(
        f"parallel.pp = {p.pp} with parallel.pp_schedule = {p.pp_schedule!r}: {why}, but "
        f"{given} with train.micro_batch_size = {t.micro_batch_size} gives {micro_batches} "
        "micro-batch(es) per step (a schedule's micro-batches are the step's accumulation "
        "micro-batches). Raise train.global_batch_size (or train.grad_accum), lower "
        "train.micro_batch_size, or choose another schedule (GPipe takes any count)."
    )
