"""The reference model of preference tuning and of GRPO's KL term, and the DPO loss
the training step calls.

[Note: reference model]
``train.objective = dpo`` with ``dpo.loss`` sigmoid / ipo, and ``train.objective =
grpo`` with ``rl.beta > 0`` (fsdpkit.train.rl_step), compare the policy with a frozen
reference (``dpo.reference`` and ``dpo.reference_dtype`` name it for both):

- full fine-tune (``lora.rank = 0``): a second model built the way the policy is
  ([Note: one builder]: meta build, ``fsdpkit.shard`` on the same mesh, the same
  weights: ``model.hf`` + ``model.init_from``, or ``dpo.reference``), every parameter
  frozen (no gradients, no optimizer state), stored in ``dpo.reference_dtype``, and only
  run forward under ``torch.no_grad`` (it keeps no activations, and every unit is
  resharded after it: ``reshard``). It is never in a checkpoint; a resume builds it again.
- LoRA (``lora.rank > 0``): no second model. The reference log-probs are the same
  sharded model's with every peft ``LoraLayer``'s ``_disable_adapters`` flag set for the
  no-grad forward: the layer then returns its base layer's output, i.e. the frozen base.
  The flag is set directly rather than through peft's ``enable_adapters(False)``, which
  also flips ``requires_grad`` of the adapter parameters, and FSDP2 has grouped those
  (sharded) parameters by it already.
- SimPO (reference-free): neither.

With ``parallel.tp`` / ``parallel.cp`` the reference is split like the policy: it is
built from the same config (``reference_config`` changes only the model and fine-tuning
fields), so ``fsdpkit.shard`` applies the same tensor-parallel plan and Ulysses
exchange on the same mesh before FSDP2. Under tp the output head is split by
vocabulary ([Note: tensor-parallel plans]) and DPO's full-logits path gets the logits
all-gathered over it, so both models' logits are whole on every tp rank and the
log-probs need nothing more. Under cp ``DpoLoss`` gives both models
this rank's slice of every row and sums each side's log-probs over the cp ranks
([Note: preference losses over a split sequence] in fsdpkit.loss.dpo). Under
``parallel.pp`` the reference (a second model, or the policy's adapters off) is run in
the policy's stages, its log-probs from a pass of their own before the schedule
([Note: preference pairs through pipeline stages] in fsdpkit.trainable.pipeline.preference).

``DpoLoss`` is a ``LossFn``: ``train_step`` and evaluation call it as any other loss,
so accumulation, clipping and the planner's trace of the step are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from fsdpkit.config import DpoConfig, RunConfig, with_changes
from fsdpkit.data.batch import SFTBatch
from fsdpkit.errors import UserError
from fsdpkit.finetune.lora import lora_layers
from fsdpkit.finetune.prepare_model import cast_frozen
from fsdpkit.loss.answers import model_kwargs
from fsdpkit.loss.contract import logits_of
from fsdpkit.loss.dpo import REFERENCE_FREE, answer_logps, preference_loss, whole_answers
from fsdpkit.sharding import shard
from fsdpkit.sharding.context.batch import slice_batch
from fsdpkit.sharding.mesh import cp_mesh
from fsdpkit.sharding.pipeline.stages import Pipeline
from fsdpkit.trainable.build import Unsharded, build_unsharded, init_from, place

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")
"""What each DPO step adds to its metrics record (means over every rank's pairs), in
TRL's convention ([Note: preference losses]); TRL names the last two
``rewards/accuracies`` and ``rewards/margins``."""


def needs_reference(cfg: RunConfig) -> bool:
    """The objective compares the policy with a reference: DPO / IPO, or GRPO with a KL
    term (``rl.beta > 0``)."""
    if cfg.train.objective == "grpo":
        return cfg.rl.beta > 0
    return cfg.train.objective == "dpo" and cfg.dpo.loss not in REFERENCE_FREE


def needs_reference_model(cfg: RunConfig) -> bool:
    """A separate reference model is built: a reference without LoRA (under LoRA the
    reference is the base with the adapters off)."""
    return needs_reference(cfg) and not cfg.lora.rank


def reference_dtype(cfg: RunConfig, *, param_dtype: torch.dtype) -> torch.dtype:
    """``dpo.reference_dtype`` resolved: auto = bf16 when the run computes in bf16."""
    wanted = cfg.dpo.reference_dtype
    if wanted == "auto":
        return torch.bfloat16 if param_dtype == torch.bfloat16 else torch.float32
    return torch.bfloat16 if wanted == "bf16" else torch.float32


def reference_config(cfg: RunConfig) -> RunConfig:
    """The config the reference is built from: the policy's model without adapters or
    freezing (or ``dpo.reference`` as an HF directory)."""
    changes: dict[str, Any] = {
        "lora.rank": 0,
        "model.freeze": [],
        "checkpoint.adapters_only": False,
    }
    if cfg.dpo.reference:
        changes |= {"model.hf": cfg.dpo.reference, "model.factory": None, "model.init_from": None}
    return with_changes(cfg, changes, source="dpo.reference")


def build_reference_unsharded(
    cfg: RunConfig, *, vocab_size: int, device_type: str
) -> Unsharded | None:
    """Step 1 of [Note: one builder] for the reference (no process group), or None when
    the run needs no separate reference ([Note: reference model])."""
    if not needs_reference_model(cfg):
        return None
    ref_cfg = reference_config(cfg)
    unsharded = build_unsharded(ref_cfg, vocab_size=vocab_size, device_type=device_type)
    model = unsharded.built.module
    model.requires_grad_(False)
    dtype = reference_dtype(cfg, param_dtype=unsharded.precision.param_dtype)
    if dtype != torch.float32:
        cast_frozen(model, dtype, keep_norms=cfg.precision.norms_fp32)
    return unsharded


def shard_reference(
    unsharded: Unsharded, cfg: RunConfig, *, mesh: Any, device: torch.device
) -> nn.Module:
    """Step 2 for the reference: sharded on ``mesh`` like the policy, its weights read,
    in eval mode; no optimizer (collective over ``mesh``)."""
    ref_cfg = reference_config(cfg)
    model = unsharded.built.module
    place(model, device=device)
    shard(model, ref_cfg, mesh=mesh, init=unsharded.finetune.init)
    if ref_cfg.model.init_from:
        init_from(model, Path(ref_cfg.model.init_from))
    return model.eval()


def reshard(model: nn.Module) -> None:
    """Free every unit's all-gathered parameters after a no-grad forward: units that
    skip resharding after forward (the root, edge units; [Note: edge units]) count on
    a backward to do it, which the reference never runs, so they would stay unsharded
    (the embedding and head in full) for the rest of the step."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """Within, every LoRA layer computes its base layer only ([Note: reference model])."""
    layers = list(lora_layers(model).values())
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True  # type: ignore[assignment]  # nn.Module's typing
    try:
        yield model
    finally:
        for layer, was in zip(layers, before):
            layer._disable_adapters = was


def _logits(model: nn.Module, batch: SFTBatch) -> torch.Tensor:
    """The model's logits of ``batch`` (with its global positions under cp)."""
    return logits_of(model(batch.inputs, **model_kwargs(model, batch)), tokens=batch.inputs)


class DpoLoss:
    """``loss_fn(model, batch)`` of a DPO run: the mean preference loss of the batch's
    pairs; each call keeps its rewards for ``step_metrics``."""

    def __init__(
        self,
        cfg: DpoConfig,
        *,
        reference: nn.Module | None,
        lora: bool,
        mesh: DeviceMesh | None,
        ring: bool = False,
    ) -> None:
        """``mesh``: the run's mesh; with a cp axis every batch is split over it and
        each side's log-probs summed back ([Note: preference losses over a split
        sequence] in fsdpkit.loss.dpo). None: the batch is whole on this rank.
        ``ring``: split in ring attention's head-tail chunks (fsdpkit.sharding.context.ring)."""
        self.cfg, self.reference, self.lora, self.ring = cfg, reference, lora, ring
        self.cp = None if mesh is None else cp_mesh(mesh)
        self._stats: dict[int, torch.Tensor] = {}
        """Each training micro-batch's reward sums, by the batch's id: a batch seen twice
        in a step counts once (torch's pipeline schedules run micro-batch 0 once more to
        infer shapes, on placeholder activations, before the first step)."""
        self.precomputed: dict[int, torch.Tensor] | None = None
        """Under pp: the reference's log-probs of each micro-batch (by the batch's id),
        from a pass of their own through the stages ([Note: preference pairs through
        pipeline stages] in fsdpkit.trainable.pipeline.preference)."""
        self.stages: Pipeline | None = None
        """Under pp with a separate reference: its stages, the policy's split
        (``self.reference`` is then this rank's view of them)."""
        self.collective: torch.device | None = None
        """Set (to the ranks' device): every rank joins ``step_metrics``' all-reduce,
        pairs or not (pp's stages before the last)."""

    def describe(self) -> str:
        """The run's first lines: the loss and what the reference is."""
        loss = {"sigmoid": "DPO", "ipo": "IPO", "simpo": "SimPO"}[self.cfg.loss]
        text = f"{loss} (dpo.loss = {self.cfg.loss}, beta {self.cfg.beta:g}"
        text += f", gamma {self.cfg.simpo_gamma:g})" if self.cfg.loss in REFERENCE_FREE else ")"
        if self.reference is not None:
            dtype = next(self.reference.parameters()).dtype
            what = self.cfg.reference or "the policy's starting weights"
            text += f"; reference: {what}, frozen, sharded, {str(dtype).removeprefix('torch.')}"
            text += ", in the policy's pipeline stages" if self.stages is not None else ""
        elif self.lora:
            text += "; reference: the base model with the LoRA adapters off (no second model)"
        else:
            text += "; no reference model"
        text += "; full logits of each side"
        if self.cp is not None:
            text += f", its log-probs summed over the {self.cp.size()} context-parallel slices"
        return text

    def local(self, batch: SFTBatch) -> SFTBatch:
        """This rank's part of ``batch``: its cp slice of every row, with global
        positions (fsdpkit.sharding.context.batch), or the whole batch without cp."""
        if self.cp is None:
            return batch
        return slice_batch(batch, rank=self.cp.get_local_rank(), cp=self.cp.size(), ring=self.ring)

    def reference_logps(self, model: nn.Module, batch: SFTBatch) -> torch.Tensor | None:
        """Summed answer log-probs of the reference over ``batch``'s tokens (None:
        reference-free loss)."""
        if self.cfg.loss in REFERENCE_FREE:
            return None
        with torch.no_grad():
            if self.reference is not None:
                logits = _logits(self.reference, batch)
                reshard(self.reference)
            elif self.lora:
                with adapters_off(model):
                    logits = _logits(model, batch)
            else:
                raise UserError("dpo: no reference model was built for this run")
            return answer_logps(logits, batch.targets)[0]

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if not isinstance(batch, SFTBatch) or batch.shape[0] % 2:
            raise UserError(
                "train.objective = 'dpo' needs preference pairs, but the loss got "
                f"{type(batch).__name__} {tuple(batch.shape)}; data.path must hold "
                "prompt/chosen/rejected rows (fsdpkit.data.preference)."
            )
        part = self.local(batch)
        reference: torch.Tensor | None = (
            self.precomputed[id(batch)]
            if self.precomputed is not None and self.cfg.loss not in REFERENCE_FREE
            else self.reference_logps(model, part)
        )
        policy, counts = answer_logps(_logits(model, part), part.targets)
        group = None if self.cp is None else self.cp.get_group()
        policy, reference, counts = whole_answers(policy, reference, counts, group=group)
        out = preference_loss(
            policy,
            reference,
            counts,
            kind=self.cfg.loss,
            beta=self.cfg.beta,
            gamma=self.cfg.simpo_gamma,
        )
        if torch.is_grad_enabled():  # a training step (evaluation runs under no_grad)
            c, r = out.chosen_rewards, out.rejected_rewards
            sums = [c.sum(), r.sum(), (c > r).float().sum(), (c - r).sum(), c.new_tensor(len(c))]
            self._stats[id(batch)] = torch.stack(sums)
        return out.losses.mean()

    def step_metrics(self) -> dict[str, float]:
        """Means over every data-parallel rank's pairs since the last call (collective:
        every rank calls it after each step)."""
        if not self._stats and self.collective is None:
            return {}
        total = (
            torch.stack(list(self._stats.values())).sum(0)
            if self._stats
            else torch.zeros(5, device=self.collective)
        )
        self._stats.clear()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        values = (total[:4] / total[4]).tolist()
        return dict(zip(METRICS, values))
