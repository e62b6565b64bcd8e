"""Pipeline parallelism: a rank's stages of the model, each sharded like a model of
its own, driven by one of torch's pipelining schedules.

``shard_pipeline`` cuts the meta-built model into stages ([Note: stage split],
[Note: stage modules]), applies ``fsdpkit.shard`` to each of this rank's stages over
the stage's own ranks (tp / cp / AC / compile / FSDP per block, the mesh without its
pp axis), wraps each in a ``StageModule`` that is the FSDP root of the stage, and
builds the schedule over them.

[Note: a stage's forward]
The schedule calls a stage once per micro-batch. A ``StageModule`` reads that
micro-batch (token ids or an ``SFTBatch``, handed to every stage by the step) and
runs the run's own loss call on its stage module, so every stage gives the model the
same ids, positions and context-parallel slice as one process would:

- the last stage returns ``loss_fn(stage, batch) / micro_batches``: the loss (chunked
  or not: [Note: the loss inside the root's forward] works unchanged) is its output,
  and the schedule's own loss function passes it through (``scale_grads=False``), so
  the gradients are those of ``train_step``'s summed micro-batch losses;
- any other stage runs the loss's model call with full logits and ends it as soon as
  its stage module returns (``_StageDone``, raised by a forward hook that runs after
  FSDP2's): its output is the hidden state its ``StageOutput`` head recorded;
- the received hidden state (on every stage but the first) goes to its
  ``StageInput`` embedding before the call.

[Note: stage boundaries]
A stage hands over the model's whole state only where the model's forward passes the
embedding's output unchanged to its first block, each block's output to the next, and
the last block's output to the final norm. Two checks on every forward enforce that
at the cuts (a model that scales the embedding's output in its own forward would
otherwise apply the scale again on every stage; transformers' Gemma scales inside its
embedding module, which only the first stage runs): on a stage with a
``StageInput``, its first block must receive exactly the tensor the ``StageInput``
returned; on a stage with a ``StageOutput``, the head must receive the last block's
output (or a full view of it). A model that breaks either is refused by name.

[Note: FSDP inside a stage]
The ``StageModule`` is the FSDP root of its stage (with no parameters of its own), so
torch's schedules drive FSDP2 themselves: every backward but a stage's last runs
without gradient reduction and without resharding, and after the stage's last backward
one reduce-scatter per unit reduces the whole step's gradients (torch's
``PipelineStage`` with an FSDP submodule). So a stage's parameters, once gathered in a
step, stay unsharded until its last backward, and its unsharded gradients accumulate
meanwhile: ``parallel.accum_sync = last`` with ``accum_keep_unsharded``, decided by
torch (the other settings are refused with pp). Looped schedules also gather a whole
stage before it computes (torch's UNSHARD / RESHARD actions).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from fsdpkit.config import RunConfig, with_changes
from fsdpkit.errors import ConfigError, UserError
from fsdpkit.init import Initializer
from fsdpkit.loss.answers import sft_loss
from fsdpkit.loss.contract import LossFn
from fsdpkit.loss.head import ChunkedLoss
from fsdpkit.loss.router import RouterSpec
from fsdpkit.sharding.apply import ShardPlan, shard
from fsdpkit.sharding.blocks import choose_blocks
from fsdpkit.sharding.context.batch import ContextParallelLoss
from fsdpkit.sharding.mesh import fsdp_mesh, pp_mesh
from fsdpkit.sharding.pipeline.parts import ModelEnds, model_ends, stage_module
from fsdpkit.sharding.pipeline.routing import PipelineRouting, StageRouting, stage_routing
from fsdpkit.sharding.pipeline.schedule import torch_schedule
from fsdpkit.sharding.pipeline.split import StageSplit, stage_split
from fsdpkit.sharding.pipeline.tied import TiedCopy, tied_copy
from fsdpkit.sharding.policy import resolve_precision
from fsdpkit.sharding.stage_edges import StageInput, StageOutput, TiedHeadView


def _quiet_views(unit: str) -> None:
    """A stage before the last returns the hidden state its head read: under
    transformers a full slice of the last block's output (a view), which FSDP2 warns
    about for the stage module's unit and the stage's root. Nothing writes into it in
    place; the next op is the send to the next stage (or the backward)."""
    for name in (unit, "FSDPStageModule"):
        warnings.filterwarnings(
            "ignore",
            message=rf"FSDP2-wrapped module \({re.escape(name)}\) returned a view tensor",
            category=UserWarning,
        )


class StageBoundaryError(UserError, ValueError):
    """The model's forward changes the hidden state at a stage cut ([Note: stage
    boundaries])."""


class _StageDone(Exception):
    """Ends a non-last stage's loss call with the stage's output ([Note: a stage's forward])."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.hidden = hidden


def _named(module: nn.Module) -> str:
    """The model's own class name (FSDP2 renames the class FSDP<name>)."""
    return type(module).__name__.removeprefix("FSDP")


def _hidden_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("hidden_states")


def _same(a: Any, b: Any) -> bool:
    """``a`` is ``b``, or a view of all of it (transformers slices the head's input)."""
    if a is b:
        return True
    base = a._base if isinstance(a, torch.Tensor) else None
    return base is not None and base is b and tuple(a.shape) == tuple(base.shape)


class StageModule(nn.Module):
    """One pipeline stage as the schedule runs it ([Note: a stage's forward])."""

    entry: StageInput | None
    """The stage's input embedding stand-in (None on the first stage)."""
    exit: StageOutput | None
    """The stage's output head stand-in (None on the last stage)."""

    def __init__(
        self, part: nn.Module, *, stage: int, last: bool, loss_fn: LossFn, blocks: list[nn.Module]
    ) -> None:
        super().__init__()
        self.part = part
        self.stage, self.last = stage, last
        self.loss_fn = loss_fn if last else _model_call_loss(loss_fn)
        self.batches: Sequence[Any] = ()
        """The step's micro-batches (set by the step before the schedule runs)."""
        self.mean_over = 1
        """What the last stage divides each micro-batch's loss by (their count)."""
        self.micro_batch: int | None = None
        """The micro-batch the schedule runs next (set by its PipelineStage)."""
        # plain attributes, not submodules: a tied last stage's entry holds a weight
        # that ``part``'s FSDP units own (the stage root must not shard it again)
        self.__dict__["entry"] = next(
            (m for m in part.modules() if isinstance(m, StageInput)), None
        )
        self.__dict__["exit"] = next(
            (m for m in part.modules() if isinstance(m, StageOutput)), None
        )
        self._last: Any = None
        self.routing: StageRouting | None = None
        """The stage's part of a mixture-of-experts model's router loss."""
        self._check_boundaries(blocks)
        if not last:
            part.register_forward_hook(self._done)
            _quiet_views(type(part).__name__)

    def forward(self, *args: torch.Tensor) -> Any:
        index = self.micro_batch if self.micro_batch is not None else 0
        self.micro_batch = None
        batch = self.batches[index]
        if self.entry is not None:
            self.entry.pending = args[0]
        routing = self.routing if self.training else None  # [Note: the router loss across
        recording: AbstractContextManager[list[torch.Tensor]] = (  # stages]: a second tensor
            routing.recorder.recording() if routing else nullcontext([])
        )
        try:
            with recording as logits:
                out = self._run(batch)
        finally:
            if self.entry is not None:
                self.entry.pending = None
        if routing is None:
            return out
        sums = routing.sums(logits, received=args[1] if len(args) > 1 else None)
        return out + routing.loss(sums) / self.mean_over if self.last else (out, sums)

    def _run(self, batch: Any) -> torch.Tensor:
        """The last stage's loss (its share of the step's), another stage's hidden state."""
        if self.last:
            return self.loss_fn(self.part, batch) / self.mean_over
        try:
            self.loss_fn(self.part, batch)
        except _StageDone as done:
            return done.hidden
        raise StageBoundaryError(
            f"pipeline stage {self.stage}: the loss did not call the model's forward."
        )

    def _done(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        """After the stage module's forward (and FSDP2's hook): end the loss call."""
        assert self.exit is not None
        seen, last = self.exit.seen, self._last
        self.exit.seen, self._last = None, None
        if seen is None or not _same(seen, last):
            raise StageBoundaryError(
                f"pipeline stage {self.stage}: {_named(self.part)}'s output head does "
                "not read its last block's output (the forward changes the hidden state "
                "after the blocks, or never calls the head), so the stage has no hidden "
                "state to send on. fsdpkit cannot cut this model into pipeline stages; "
                "use parallel.pp = 1."
            )
        raise _StageDone(seen)

    def _check_boundaries(self, blocks: list[nn.Module]) -> None:
        """[Note: stage boundaries]: what the entry returned (after tensor parallelism's
        hooks), checked by a pre-hook that runs before any other on the first block; a
        hook that runs after the others on the last block."""
        self._entered: Any = None
        if self.entry is not None:
            self.entry.register_forward_hook(self._entry_output)
            blocks[0].register_forward_pre_hook(self._first_input, with_kwargs=True, prepend=True)
        if self.exit is not None:
            blocks[-1].register_forward_hook(self._last_output)

    def _entry_output(self, _module: nn.Module, _args: Any, output: Any) -> None:
        self._entered = output

    def _first_input(self, _module: nn.Module, args: Any, kwargs: Any) -> None:
        """The first block's input must be the entry's output, or a view of all of it
        (what the planner's fake tensors hand on: fsdpkit.planner.pipeline.traced)."""
        entered, self._entered = self._entered, None
        if entered is not None and not _same(_hidden_of(args, kwargs), entered):
            raise StageBoundaryError(
                f"pipeline stage {self.stage}: {_named(self.part)}'s forward changes the "
                "input embedding's output before its first block (e.g. scales it), so a "
                "stage that receives hidden states would change them again. fsdpkit "
                "cannot cut this model into pipeline stages; use parallel.pp = 1."
            )

    def _last_output(self, _module: nn.Module, _args: Any, output: Any) -> None:
        self._last = output


def _model_call_loss(loss_fn: LossFn) -> LossFn:
    """The loss whose model call a stage before the last runs: a chunked loss needs the
    model's head, which such a stage lacks, so it becomes the full-logits loss (the
    call ends before any logits are made)."""
    if isinstance(loss_fn, ChunkedLoss):
        return sft_loss
    if isinstance(loss_fn, ContextParallelLoss) and isinstance(loss_fn.inner, ChunkedLoss):
        return replace(loss_fn, inner=sft_loss)
    return loss_fn


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them."""

    schedule: Any
    """torch's schedule (PipelineScheduleSingle or PipelineScheduleMulti); None for a
    frozen model that only runs forwards (``shard_pipeline(..., frozen=True)``)."""
    stages: list[StageModule]
    """This rank's stages, in stage order."""
    split: StageSplit
    group: Any
    """The pipeline process group (this rank's pp axis)."""
    micro_batches: int
    plans: list[ShardPlan] = field(default_factory=list)
    """What ``fsdpkit.shard`` did to each of this rank's stages."""
    group_names: list[list[str]] | None = None
    """The whole model's parameter names per optimizer group, for checkpoints ([Note:
    optimizer groups across stages] in fsdpkit.checkpoint.statefuls)."""
    tied: TiedCopy | None = None
    """This rank's copy of a tied embedding and head ([Note: tied embeddings across
    stages] in fsdpkit.sharding.pipeline.tied); None when untied or on a middle stage."""
    tied_names: dict[str, str] = field(default_factory=dict)
    """The whole model's tied aliases (``{alias: name}``), for the checkpoint's record."""
    routing: PipelineRouting | None = None
    """A mixture-of-experts model's router loss across the stages (None: no router loss)."""

    @property
    def holds_last(self) -> bool:
        return any(s.last for s in self.stages)

    def uncounted(self) -> list[torch.Tensor]:
        """This rank's parameters that a sum over the whole model (the gradient norm, the
        frozen base's fingerprint) skips: the last stage's copy of a tied weight, which
        the first stage's counts ([Note: tied embeddings across stages])."""
        tied = self.tied
        return [tied.param] if tied is not None and not tied.counted else []

    def describe(self) -> str:
        """For the run's first lines: the schedule and which blocks each rank holds."""
        p = self.split
        head = (
            f"pipeline: {len(set(p.ranks))} ranks x {p.stages // len(set(p.ranks))} stage(s), "
            f"{type(self.schedule).__name__} over {self.micro_batches} micro-batches"
        )
        tied = (  # [Note: tied embeddings across stages] in fsdpkit.sharding.pipeline.tied
            "\ntied embedding and head: the last stage holds a copy of the weight, its "
            "gradient summed with the first stage's every step"
            if self.tied_names
            else ""
        )
        return head + "\n" + p.describe() + tied


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _split(model: nn.Module, ends: ModelEnds, cfg: RunConfig) -> StageSplit:
    blocks = [model.get_submodule(b) for b in ends.blocks]
    norm = model.get_submodule(ends.norm) if ends.norm else None
    edge = (
        _numel(model.get_submodule(ends.embedding)),
        _numel(norm) + _numel(model.get_submodule(ends.head)),
    )
    return stage_split(cfg, block_params=[_numel(b) for b in blocks], edge_params=edge)


def shard_pipeline(
    model: nn.Module,
    cfg: RunConfig,
    *,
    mesh: DeviceMesh,
    loss_fn: LossFn,
    micro_batches: int,
    device: torch.device,
    init: Initializer | None = None,
    router: RouterSpec | None = None,
    frozen: bool = False,
) -> tuple[Pipeline, nn.Module]:
    """Cut the meta-built ``model`` into stages, shard and materialize this rank's
    (``fsdpkit.shard`` on each, over ``mesh`` without its pp axis), and build the
    schedule; returns it with the rank's view of its parameters ([Note: stage
    modules]). ``loss_fn``: the run's loss (context-parallel already); ``router``: a
    mixture-of-experts model's router loss ([Note: the router loss across stages]);
    ``frozen``: a model that only runs forwards through the stages (DPO's reference:
    fsdpkit.trainable.pipeline.preference), so no schedule and no router loss."""
    group = pp_mesh(mesh)
    if group is None:
        raise ConfigError("shard_pipeline needs a mesh with a pp axis (parallel.pp > 1).")
    choice = choose_blocks(model, class_names=cfg.parallel.block_classes or None)
    blocks = list(choice.blocks)
    ends = model_ends(model, blocks=blocks)
    split = _split(model, ends, cfg)
    local = split.local(group.get_local_rank())
    last = split.stages - 1
    classes = sorted({type(b).__name__ for b in blocks})
    stage_cfg = with_changes(cfg, {"parallel.block_classes": classes}, source="parallel.pp")
    parts = {
        s: stage_module(model, ends, keep=set(split.blocks[s]), first=s == 0, last=s == last)
        for s in local
    }
    entry = parts[last].get_submodule(ends.embedding) if last in parts else None
    view = parts[local[0]] if len(local) == 1 else _view(model, ends, split, local, entry)
    precision = resolve_precision(cfg.precision, device_type=device.type)
    stages, plans = [], []
    for s, part in parts.items():
        made = shard(part, stage_cfg, mesh=mesh, init=init)  # the model's own block choice:
        plans.append(replace(made, block_reason=choice.reason))  # not "set by block_classes"
        own = [blocks[b] for b in split.blocks[s]]
        stage = StageModule(part, stage=s, last=s == last, loss_fn=loss_fn, blocks=own)
        fully_shard(stage, mesh=fsdp_mesh(mesh), mp_policy=precision.policy())
        stages.append(stage)
    schedule = None
    if not frozen:
        name, n = cfg.parallel.pp_schedule, micro_batches
        schedule = torch_schedule(name, stages, split=split, group=group, device=device, n=n)
    pipe = Pipeline(schedule, stages, split, group.get_group(), micro_batches, plans)
    if router is not None and not frozen:
        pipe.routing = stage_routing(
            stages, spec=router, mesh=mesh, view=view, device=device, micro_batches=micro_batches
        )
    if ends.tied:
        pipe.tied = tied_copy(stages, ends, split=split, mesh=mesh, view=view)
    return pipe, view


def _view(
    model: nn.Module, ends: ModelEnds, split: StageSplit, local: list[int], entry: Any
) -> nn.Module:
    keep = {b for s in local for b in split.blocks[s]}
    first, last = 0 in local, split.stages - 1 in local
    head = TiedHeadView() if ends.tied and first and last else None  # [Note: tied embeddings
    return stage_module(  # across stages] in fsdpkit.sharding.pipeline.tied
        model, ends, keep=keep, first=first, last=last, entry=entry, head=head
    )
