"""Preference tuning under ``parallel.pp``: DPO's reference log-probs in a pass of their
own through the stages, before the schedule's step.

[Note: preference pairs through pipeline stages]
DPO's loss compares the policy's log-probs of each pair's answers with the reference's
([Note: reference model]). Under pp no rank holds a whole reference: its log-probs are
a whole forward through every stage, which the last stage's loss call alone cannot
run. So before each step (and each evaluation) the micro-batches go once through the
reference's stages forwards only, the last stage computing the reference's summed
answer log-probs per row (``reference_pass``, fsdpkit.trainable.pipeline.step.
forward_only); the step's schedule then runs the policy, and the last stage's
``DpoLoss`` takes those log-probs by micro-batch instead of running a reference
itself. The stages before the last run the policy's model call only (the SFT loss's
call: the same ids and positions as DPO's policy forward). The reference's stages:

- under LoRA, the policy's own stages with every stage's adapters off (the frozen
  base, no second model);
- in full fine-tuning, a second model built from the reference's config and cut by
  the same rule (``shard_reference_stages``: the same split, so each rank holds the
  same blocks of both, and the last stage, whose rank computes the loss, is the same
  rank's), sharded like the policy's stages, frozen, and never run by the schedule.
  After each pass every one of its units is resharded (``reshard``), so between
  passes a rank holds its shards only.

Context parallelism with DPO is refused with pp (not split into stages yet); SimPO
needs no reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdpkit.config import RunConfig
from fsdpkit.loss.answers import model_kwargs, sft_loss
from fsdpkit.loss.contract import logits_of
from fsdpkit.loss.dpo import REFERENCE_FREE, answer_logps
from fsdpkit.sharding.pipeline.stages import Pipeline, shard_pipeline
from fsdpkit.trainable.build import Unsharded, init_from, place
from fsdpkit.trainable.pipeline.step import forward_only
from fsdpkit.trainable.reference import DpoLoss, adapters_off, reference_config, reshard


def pipelined_dpo(
    pipe: Pipeline, dpo: DpoLoss, *, reference: tuple[Pipeline, nn.Module] | None = None
) -> None:
    """Make ``dpo`` the last stage's loss and the policy's model call the others'
    ([Note: preference pairs through pipeline stages]); ``reference``: a separate
    reference's stages and view (``shard_reference_stages``)."""
    if reference is not None:
        dpo.stages, dpo.reference = reference
    dpo.collective = next(pipe.stages[0].parameters()).device  # every rank reduces metrics
    for stage in pipe.stages:
        stage.loss_fn = dpo if stage.last else sft_loss


def _reference_logps(part: nn.Module, batch: Any) -> torch.Tensor:
    logits = logits_of(part(batch.inputs, **model_kwargs(part, batch)), tokens=batch.inputs)
    return answer_logps(logits, batch.targets)[0]


def shard_reference_stages(
    unsharded: Unsharded,
    cfg: RunConfig,
    *,
    like: Pipeline,
    mesh: DeviceMesh,
    device: torch.device,
) -> tuple[Pipeline, nn.Module]:
    """The separate reference (full fine-tuning) in this rank's stages of the policy's
    split, sharded like them, its weights read, forward only over ``like``'s (the
    policy's) micro-batches; with the rank's view of its parameters ([Note: preference
    pairs through pipeline stages]; collective over ``mesh``)."""
    ref_cfg = reference_config(cfg)
    model = unsharded.built.module
    place(model, device=device)
    pipe, view = shard_pipeline(
        model,
        ref_cfg,
        mesh=mesh,
        loss_fn=sft_loss,
        micro_batches=like.micro_batches,
        device=device,
        init=unsharded.finetune.init,
        frozen=True,
    )
    if ref_cfg.model.init_from:  # each rank reads its stages' weights, as the policy's
        init_from(view, Path(ref_cfg.model.init_from))
    return pipe, view.eval()


def reference_pass(pipe: Pipeline, dpo: DpoLoss, micro_batches: Sequence[Any]) -> None:
    """The reference's log-probs of ``micro_batches`` into ``dpo.precomputed`` (on the
    rank that holds the last stage); collective over the pipeline group. ``pipe``: the
    policy's stages (the reference's under LoRA, with the adapters off)."""
    if dpo.cfg.loss in REFERENCE_FREE:
        return
    if dpo.stages is not None:  # a second model in the same stages
        outs = forward_only(dpo.stages, micro_batches, last=_reference_logps)
        for stage in dpo.stages.stages:
            reshard(stage)
    else:
        with ExitStack() as stack:
            for stage in pipe.stages:
                stack.enter_context(adapters_off(stage.part))
            outs = forward_only(pipe, micro_batches, last=_reference_logps)
    dpo.precomputed = {id(b): o for b, o in zip(micro_batches, outs) if o is not None}
