"""Step 2 of [Note: one builder] under ``parallel.pp``: the rank's stages of the
prepared model, their loss and schedule (fsdpkit.sharding.pipeline.stages), and the view of
the rank's parameters the optimizer, clipping and checkpoints use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdpkit.checkpoint.statefuls import tied_aliases
from fsdpkit.config import RunConfig, batch_split
from fsdpkit.config.dims import MeshAxis
from fsdpkit.errors import ConfigError
from fsdpkit.loss.contract import LossFn
from fsdpkit.loss.router import RouterSpec, router_spec
from fsdpkit.sharding.context.batch import context_parallel_loss
from fsdpkit.sharding.mesh import cp_mesh
from fsdpkit.sharding.pipeline.routing import check_stage_router, takes_sums
from fsdpkit.sharding.pipeline.stages import Pipeline, shard_pipeline
from fsdpkit.trainable.optim import group_names


@dataclass
class PipelineBuild:
    """What ``build_pipeline`` made."""

    pipeline: Pipeline
    view: nn.Module
    """This rank's parameters under the model's names ([Note: stage modules])."""
    loss_fn: LossFn
    """The loss the last stage computes (context-parallel where cp > 1)."""
    router: RouterSpec | None = None
    """A mixture-of-experts model's router loss, carried across the stages ([Note: the
    router loss across stages])."""


def data_ranks(mesh: DeviceMesh) -> int:
    """The data-parallel ranks of one stage: the product of the mesh's data axes (under
    ep the shard axis is efsdp x ep: [Note: parallel dimensions])."""
    names = mesh.mesh_dim_names or ()
    size = 1
    for axis in (MeshAxis.REPLICATE, MeshAxis.SHARD, MeshAxis.EFSDP, MeshAxis.EP):
        if axis in names:
            size *= mesh[axis].size()
    return size


def build_pipeline(
    unsharded: Any, cfg: RunConfig, *, mesh: DeviceMesh, device: torch.device
) -> PipelineBuild:
    """This rank's stages of ``unsharded`` (fsdpkit.trainable.build.Unsharded), sharded
    and materialized, and their schedule over the step's micro-batches."""
    model = unsharded.built.module
    loss_fn: LossFn = unsharded.loss_fn
    router = router_spec(model, coef=cfg.model.router_aux_loss_coef)
    check_stage_router(router)  # [Note: the router loss across stages]
    if router is not None and not (router.aux_fn and takes_sums(router)):
        router = None  # no router loss (or none at coefficient 0 that fsdpkit can carry)
    cp = cp_mesh(mesh)
    if cp is not None:
        ring = cfg.parallel.cp_attention == "ring"
        loss_fn = context_parallel_loss(loss_fn, mesh=cp, ring=ring)
    micro_batches = batch_split(cfg.train, dp_world=data_ranks(mesh)).grad_accum
    names = group_names(model)  # before the model is cut into stages
    tied = tied_aliases(model)
    pipeline, view = shard_pipeline(
        model,
        cfg,
        mesh=mesh,
        loss_fn=loss_fn,
        micro_batches=micro_batches,
        device=device,
        init=unsharded.finetune.init,
        router=router,
    )
    pipeline.group_names, pipeline.tied_names = names, tied
    _require_something_to_train(pipeline, view)
    return PipelineBuild(pipeline=pipeline, view=view, loss_fn=loss_fn, router=router)


def _require_something_to_train(pipeline: Pipeline, view: nn.Module) -> None:
    """Every pipeline rank must train something: a rank whose stages are all frozen
    (``model.freeze`` of the first blocks and the embedding) would get an optimizer
    over nothing. Checked on every rank of the pipeline group together, so all of them
    stop with the same paragraph."""
    mine = any(p.requires_grad for p in view.parameters())
    flags: list[Any] = [None] * dist.get_world_size(pipeline.group)
    dist.all_gather_object(flags, mine, group=pipeline.group)
    idle = [rank for rank, trains in enumerate(flags) if not trains]
    if idle:
        held = "; ".join(pipeline.split.describe().splitlines()[r] for r in idle)
        raise ConfigError(
            f"model.freeze leaves pipeline rank(s) {idle} nothing to train ({held}): "
            "every pipeline rank needs trainable parameters. Freeze fewer blocks, move "
            "the cut with parallel.pp_split / fewer stages (parallel.pp), or train the "
            "frozen run without parallel.pp."
        )
