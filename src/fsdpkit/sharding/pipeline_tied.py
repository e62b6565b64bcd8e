"""A tied input embedding and output head under pipeline parallelism: one copy of the
weight on the first stage and one on the last, kept equal.

[Note: tied embeddings across stages]
The first stage runs the embedding, the last the head, on different ranks, so each
holds the weight (Megatron's "embedding group"): the first stage's embedding keeps it
under its own name, and the last stage is itself a tied model (its ``TiedStageInput``
holds the head's weight under the embedding's name: [Note: stage modules] in
fsdpkit.sharding.pipeline_parts). So everything that reads names sees the whole
model's: the per-parameter init, Hugging Face weights, and checkpoints, where both
copies save the one tensor ``model.embed_tokens.weight`` (the alias dropped as in any
tied model: [Note: tied weights] in fsdpkit.checkpoint.state) with identical bytes, so
a pipelined checkpoint resumes without pp and exports as always. Both copies are
sharded alike (FSDP over the stage's data ranks, by vocabulary over tp), so the
first stage's rank and the last stage's rank of one pipeline, at the same data, tp
and cp coordinates, hold the same slice; over those two ranks (the tie group):

- at build the last stage's copy takes the first stage's values (a broadcast), so the
  two start equal whatever initialised them (transformers' init draws the head and
  embedding separately);
- after the schedule, when each stage has reduced its gradients, the two gradients
  are summed (an all-reduce): each copy's gradient is then the whole model's, the
  embedding's and the head's together, as autograd sums them for one tied weight;
- gradient clipping counts the first stage's copy only (``counted``), and AdamW,
  stepping two equal weights with equal gradients, keeps them and their states equal.

A V schedule holds the first and last stage on one rank, where both copies would be
one rank's; it is refused (fsdpkit.sharding.pipeline_split.tied_refusal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class TiedCopy:
    """This rank's copy of the tied weight and the group it is kept equal over."""

    param: torch.Tensor
    """The parameter (a DTensor under FSDP)."""
    group: Any
    """The tie group: this pipeline's first-stage rank and last-stage rank."""
    source: int
    """The first stage's rank (global)."""
    counted: bool
    """Whether clipping counts it (the first stage's copy)."""


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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


@torch.no_grad()
def share_first_copy(tied: TiedCopy) -> None:
    """The last stage's copy takes the first stage's values ([Note: tied embeddings
    across stages])."""
    dist.broadcast(_local(tied.param), src=tied.source, group=tied.group)


@torch.no_grad()
def sum_tied_grads(tied: TiedCopy) -> None:
    """Both copies' gradients become their sum."""
    grad = tied.param.grad
    if grad is None:
        raise RuntimeError("pipeline: the tied embedding's copy has no gradient after the step")
    dist.all_reduce(_local(grad), op=dist.ReduceOp.SUM, group=tied.group)
