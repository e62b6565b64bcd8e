"""Preference tuning under ``parallel.pp``: DPO's reference log-probs in a pass of their
own through the stages, before the schedule's step.

[Note: preference pairs through pipeline stages]
DPO's loss compares the policy's log-probs of each pair's answers with the reference's.
Under LoRA the reference is the base with the adapters off ([Note: reference model]);
under pp every stage holds a part of that base, so the reference's log-probs are a
whole forward through every stage with each stage's adapters off, which the last
stage's loss call alone cannot run. So before each step (and each evaluation) the
micro-batches go once through the stages forwards only, adapters off on every rank,
the last stage computing the reference's summed answer log-probs per row
(``reference_pass``, fsdpkit.trainable.pipeline.step.forward_only); the step's schedule
then runs the policy, and the last stage's ``DpoLoss`` takes those log-probs by
micro-batch instead of running a reference itself. The stages before the last run the
policy's model call only (the SFT loss's call: the same ids and positions as DPO's
policy forward). A separate frozen reference model (full fine-tuning) and context
parallelism are refused with pp (not split into stages yet); SimPO needs no reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from fsdpkit.loss.answers import model_kwargs, sft_loss
from fsdpkit.loss.contract import logits_of
from fsdpkit.loss.dpo import REFERENCE_FREE, answer_logps
from fsdpkit.sharding.pipeline.stages import Pipeline
from fsdpkit.trainable.pipeline.step import forward_only
from fsdpkit.trainable.reference import DpoLoss, adapters_off


def pipelined_dpo(pipe: Pipeline, dpo: DpoLoss) -> None:
    """Make ``dpo`` the last stage's loss and the policy's model call the others'
    ([Note: preference pairs through pipeline stages])."""
    dpo.collective = next(pipe.stages[0].parameters()).device  # every rank reduces metrics
    for stage in pipe.stages:
        stage.loss_fn = dpo if stage.last else sft_loss


def _reference_logps(part: nn.Module, batch: Any) -> torch.Tensor:
    logits = logits_of(part(batch.inputs, **model_kwargs(part, batch)), tokens=batch.inputs)
    return answer_logps(logits, batch.targets)[0]


def reference_pass(pipe: Pipeline, dpo: DpoLoss, micro_batches: Sequence[Any]) -> None:
    """The reference's log-probs of ``micro_batches`` into ``dpo.precomputed`` (on the
    rank that holds the last stage); collective over the pipeline group."""
    if dpo.cfg.loss in REFERENCE_FREE:
        return
    with ExitStack() as stack:
        for stage in pipe.stages:
            stack.enter_context(adapters_off(stage.part))
        outs = forward_only(pipe, micro_batches, last=_reference_logps)
    dpo.precomputed = {id(b): o for b, o in zip(micro_batches, outs) if o is not None}
