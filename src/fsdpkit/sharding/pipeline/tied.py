"""A tied input embedding and output head under pipeline parallelism: one copy of the
weight on the first stage and one on the last, kept equal.

[Note: tied embeddings across stages]
The first stage runs the embedding, the last the head, so each holds the weight
(Megatron's "embedding group"): the first stage's embedding keeps it under its own
name, and the last stage is itself a tied model (its ``TiedStageInput`` holds the
head's weight under the embedding's name: [Note: stage modules] in
fsdpkit.sharding.pipeline.parts). So everything that reads names sees the whole
model's: the per-parameter init, Hugging Face weights, and checkpoints, where a copy
saves the one tensor ``model.embed_tokens.weight`` (the alias dropped as in any tied
model: [Note: tied weights] in fsdpkit.checkpoint.statefuls), so a pipelined checkpoint
resumes without pp and exports as always. Both copies are sharded alike (FSDP over
the stage's data ranks, by vocabulary over tp), so each of a copy's shards has its
twin of the same slice. Two cases:

- the first and last stage on different pipeline ranks (1F1B, GPipe, interleaved and
  looped schedules): over those two ranks at the same data, tp and cp coordinates
  (the tie group), the last stage's copy takes the first's values at build (a
  broadcast: transformers' init draws the head and embedding apart); after the
  schedule, when each stage has reduced its gradients, the two gradients are summed
  (an all-reduce), so each copy's is the whole model's, the embedding's and the
  head's together, as autograd sums them for one tied weight; clipping counts the
  first stage's copy only (``counted``); each rank's AdamW steps its copy, and two
  equal weights with equal gradients stay equal, their states too. The last rank
  holds a copy's gradient and optimizer state as well: what Megatron holds.
- both on one rank (the V schedules: stage 0 and stage ``2 pp - 1``): the rank's view
  holds the first stage's copy alone, under both names (a tied model again: one
  tensor in checkpoints, one optimizer state); the last stage's copy (``twin``) takes
  the first's values before every step and every evaluation (after a checkpoint load
  too), and after the schedule its gradient is added to the first's and dropped. The
  optimizer steps the first copy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdpkit.sharding.pipeline.parts import ModelEnds
from fsdpkit.sharding.pipeline.split import StageSplit


@dataclass(frozen=True)
class TiedCopy:
    """This rank's copy of the tied weight and how it is kept equal to the other."""

    param: torch.Tensor
    """The copy the optimizer steps (a DTensor under FSDP)."""
    group: Any
    """The tie group (this pipeline's first-stage and last-stage rank); None when both
    stages are this rank's."""
    source: int
    """The first stage's rank (global); -1 when both stages are this rank's."""
    counted: bool
    """Whether clipping counts ``param`` (the first stage's copy)."""
    twin: torch.Tensor | None = None
    """The last stage's copy when this rank holds both ends (not stepped)."""


def tie_group(mesh: DeviceMesh, *, first: int, last: int) -> tuple[Any, int]:
    """Every pipeline's tie group (every rank must call this: ``new_group`` is
    collective over the world), and this rank's with its first stage's global rank
    ((None, -1) where it holds neither end). ``first`` / ``last``: the pipeline ranks
    of the first and last stage; ``mesh``: the run's mesh, pp first."""
    ranks = mesh.mesh.reshape(mesh.mesh.shape[0], -1)
    me, mine = dist.get_rank(), (None, -1)
    for column in ranks.T.tolist():
        pair = [column[first], column[last]]
        group = dist.new_group(pair)
        if me in pair:
            mine = (group, pair[0])
    return mine


def tied_copy(
    stages: list[Any], ends: ModelEnds, *, split: StageSplit, mesh: DeviceMesh, view: nn.Module
) -> TiedCopy | None:
    """This rank's copy of the tied weight, made equal to the first stage's ([Note:
    tied embeddings across stages]); ``stages``: the rank's ``StageModule``s, sharded;
    ``view``: the rank's view, whose head stand-in takes the first copy where the rank
    holds both ends. Every rank takes part in making the groups."""
    first = next((s for s in stages if s.stage == 0), None)
    last = next((s for s in stages if s.stage == split.stages - 1), None)
    if split.ranks[0] == split.ranks[-1]:
        if first is None or last is None:
            return None
        weight = first.part.get_submodule(ends.embedding).weight
        view.get_submodule(ends.head).weight = weight
        twin = last.part.get_submodule(ends.head).weight
        copy = TiedCopy(param=weight, group=None, source=-1, counted=True, twin=twin)
    else:
        group, source = tie_group(mesh, first=split.ranks[0], last=split.ranks[-1])
        if group is None:
            return None
        stage, path = (first, ends.embedding) if first is not None else (last, ends.head)
        assert stage is not None  # the tie group holds this rank: it has either end
        weight = stage.part.get_submodule(path).weight
        copy = TiedCopy(param=weight, group=group, source=source, counted=first is not None)
    share_first_copy(copy)
    return copy


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


@torch.no_grad()
def share_first_copy(tied: TiedCopy) -> None:
    """The last stage's copy takes the first stage's values ([Note: tied embeddings
    across stages]): at build."""
    if tied.twin is not None:
        refresh_twin(tied)
    else:
        dist.broadcast(_local(tied.param), src=tied.source, group=tied.group)


@torch.no_grad()
def refresh_twin(tied: TiedCopy | None) -> None:
    """Where one rank holds both copies, the last stage's takes the first's values
    (before every step and evaluation: the optimizer and a checkpoint load change the
    first only); nothing otherwise."""
    if tied is not None and tied.twin is not None:
        _local(tied.twin).copy_(_local(tied.param))


@torch.no_grad()
def sum_tied_grads(tied: TiedCopy) -> None:
    """The first copy's gradient becomes the sum of both copies' (the last copy's too
    over a tie group; dropped where one rank holds both). A frozen tied weight (the base
    under LoRA) has no gradient on either copy, both copies frozen alike (by the
    embedding's name each is registered under), so nothing is summed."""
    if not tied.param.requires_grad:
        return
    grad = tied.param.grad
    if grad is None:
        raise RuntimeError("pipeline: the tied embedding's copy has no gradient after the step")
    if tied.twin is None:
        dist.all_reduce(_local(grad), op=dist.ReduceOp.SUM, group=tied.group)
        return
    if tied.twin.grad is None:
        raise RuntimeError("pipeline: the tied head's copy has no gradient after the step")
    _local(grad).add_(_local(tied.twin.grad))
    tied.twin.grad = None
