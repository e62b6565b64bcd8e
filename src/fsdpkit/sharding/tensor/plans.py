"""Tensor and sequence parallelism: which linear layers split how, applied with
torch's ``parallelize_module`` before FSDP2 shards what is left over the data ranks.

[Note: tensor-parallel plans]
Every block splits its attention by heads and its MLP by hidden units (Megatron's
pairing): q/k/v and gate/up are column-parallel (each tp rank computes its heads /
hidden units), o and down are row-parallel (partial sums reduced over tp). The plan
comes from:

- the built-in Llama: fsdpkit's plan, with sequence parallelism: the norms and the
  residual stream between blocks hold seq / tp tokens per rank; each attention and
  MLP input is all-gathered over the sequence and each o / down output
  reduce-scattered back (the same bytes as the all-reduces they replace);
- a transformers model: its config's ``base_model_tp_plan``, whose ``layers.*.NAME``
  entries must all be ``PLAN_KINDS``: colwise / rowwise linears and
  ``replicated_with_grad_allreduce`` modules (the per-head q / k norms of Qwen3,
  Gemma3, Exaone4: between a column- and a row-parallel linear each tp rank
  normalizes its own heads with the same weight, so that weight is a replicated
  DTensor over tp whose input is declared split: DTensor makes its gradient a
  partial sum, reduced over tp before FSDP2 reduce-scatters it over the data ranks).
  A config without such a plan is refused, whatever its module names; so are plans
  with other entries: ``colwise_gather_output`` / ``rowwise_split_input`` (OLMo2 /
  OLMo3, whose q / k norms normalize the whole hidden q / k; Phi3 and GLM, whose
  fused qkv / gate_up projections those entries gather), packed or expert entries,
  every mixture-of-experts config (by its expert count, ``_experts``), and plans that
  leave a parameter of a block's split layers unplanned (``check_covered``: Apertus'
  xIELU activation between up and down, whose gradient would differ between the tp
  ranks). Where its blocks hold only ``self_attn``, ``mlp`` and norms and it ends
  in ``model.norm`` (the rule of fsdpkit.sharding.tensor.sequence) it gets sequence
  parallelism too: its body computes masks and positions from the embedding output's
  length, so the sequence is split at the first block's input instead of the
  embedding's output (fsdpkit.sharding.tensor.edges); other families keep the residual stream whole;
- anything else is refused by name (``TensorParallelError``).

The embedding and the output head are split by vocabulary rows over tp (loss
parallel, as torchtitan): the embedding is row-parallel (each rank looks up the ids
in its rows, zeros elsewhere; the partial sums are all-reduced, or reduce-scattered
over the sequence under sequence parallelism), the head column-parallel on the whole
hidden states. The chunked loss (fsdpkit.loss.head) reads the head's local rows and
computes the cross-entropy vocabulary-parallel ([Note: vocabulary-parallel
cross-entropy] in fsdpkit.loss.chunked_ce): each tp rank does V / tp of the head's
matmuls and holds V / tp of its weight and chunk buffers, and nothing of vocabulary
size crosses the wire. A loss that asks for the logits (``train.chunked_loss =
off``, a model that post-processes them, sampling) gets them all-gathered over the
vocabulary. A tied pair is one row-sharded parameter and stays tied. The embedding
and head stay whole (replicated over tp, FSDP-sharded over the data ranks, the
head's matmul repeated on each tp rank) where they are not a plain ``nn.Embedding``
and ``nn.Linear`` (a LoRA-wrapped head) or the vocabulary does not split evenly; the
run's first lines say so. The final norm's weight is not split.

LoRA adapters (peft) on a split linear follow their base: on a column-parallel base
``lora_B`` is column-parallel and ``lora_A`` replicated; on a row-parallel base
``lora_A`` is row-parallel and ``lora_B`` replicated (under sequence parallelism it
runs on the sequence shard, its weight a replicated DTensor whose gradient DTensor
reduces over tp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdpkit.models.llama import Llama
from fsdpkit.sharding.tensor.edges import edges
from fsdpkit.sharding.tensor.moe import moe_styles, shared_linears
from fsdpkit.sharding.tensor.rules import (
    MLP,
    REPLICATED,
    block_entries,
    check_model,
    moe_mlp,
    sequence_parallel_applies,
)
from fsdpkit.sharding.tensor.sequence import sequence_parallel_styles


@dataclass(frozen=True)
class TensorPlan:
    """What ``tensor_parallel`` applied, for the run's first lines."""

    source: str
    """Where the block plan came from."""
    sequence_parallel: bool
    linears: int
    """Linear layers split (per model, all blocks)."""
    replicated: int = 0
    """Modules replicated over tp with their gradients reduced (per-head q / k norms)."""
    whole_vocab: str | None = None
    """Why the embedding and head were not split by vocabulary (None: they were)."""
    moe_blocks: int = 0
    """Mixture-of-experts blocks, whose MLP runs on each rank's own tokens ([Note:
    experts under tensor parallelism] in fsdpkit.sharding.tensor.moe)."""

    def describe(self, tp: int) -> str:
        sp = ", sequence parallel" if self.sequence_parallel else ""
        vocab = (
            "embedding and head split by vocabulary, loss parallel"
            if self.whole_vocab is None
            else f"embedding and head whole: {self.whole_vocab}"
        )  # no "; ": the run's first line joins its parts with it
        norms = f", {self.replicated} per-head norms replicated" if self.replicated else ""
        moe = (
            f", experts and routers of {self.moe_blocks} MoE block"
            f"{'s' if self.moe_blocks > 1 else ''} on each rank's own tokens"
            if self.moe_blocks
            else ""
        )
        return (
            f"tensor parallel {tp} ({self.source}{sp}: {self.linears} linears split{norms}"
            f"{moe}, {vocab})"
        )


def _styles(kind: str, *, sequence_parallel: bool) -> ParallelStyle:
    if kind == "colwise":
        return ColwiseParallel()
    return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()


def _linear_plan(
    block: nn.Module, name: str, kind: str, *, sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """Styles of one planned linear: itself, or a peft LoRA layer's base and adapters."""
    module = block.get_submodule(name)
    if not hasattr(module, "base_layer"):
        return {name: _styles(kind, sequence_parallel=sequence_parallel)}
    plan = {f"{name}.base_layer": _styles(kind, sequence_parallel=sequence_parallel)}
    for adapter in getattr(module, "lora_A", {}):
        if kind == "colwise":  # lora_A replicated: it sees the whole input
            plan[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
            continue
        out = Shard(1) if sequence_parallel else Replicate()
        plan[f"{name}.lora_A.{adapter}"] = RowwiseParallel(output_layouts=out)
        if sequence_parallel:  # on the sequence shard; its grad reduced over tp
            plan[f"{name}.lora_B.{adapter}"] = SequenceParallel(use_local_output=True)
    return plan


def replicated_grad_reduced() -> ParallelStyle:
    """A ``replicated_with_grad_allreduce`` module (a per-head q / k norm between a
    column- and a row-parallel linear): its parameters replicated DTensors over tp and
    its input, this rank's heads, declared split over dim 0 (any dim but the
    normalized last one says the same: the ranks hold different rows). The weight's
    gradient, a sum over those rows, is then a partial sum that is reduced over tp (FSDP2
    redistributes it to the parameter's Replicate before its reduce-scatter); the
    output is the local tensor again."""
    return SequenceParallel(sequence_dim=0, use_local_output=True)


def tensor_parallel(
    model: nn.Module, *, mesh: DeviceMesh, blocks: list[nn.Module], cp: int = 1
) -> TensorPlan:
    """Split ``model``'s blocks over the tp ``mesh`` ([Note: tensor-parallel plans]),
    in place; call before activation checkpointing and FSDP2. ``cp``: the degree the
    heads per tp rank must divide by (fsdpkit.sharding.heads.heads_cp)."""
    tp = mesh.size()
    plan, source = check_model(model, tp=tp, cp=cp, blocks=blocks)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    sp = sequence_parallel_applies(model, blocks=blocks)
    linears = replicated = 0
    for block in blocks:
        styles = _block_styles(block, plan, sequence_parallel=sp)
        linears += sum(plan[n] != REPLICATED for n in block_entries(block, plan))
        linears += shared_linears(block)
        replicated += sum(plan[n] == REPLICATED for n in block_entries(block, plan))
        parallelize_module(block, mesh, styles)
    first = blocks[0] if sp and not isinstance(model, Llama) else None
    whole_vocab = edges(model, mesh=mesh, sequence_parallel=sp, first_block=first)
    for name, param in model.named_parameters():  # SequenceParallel makes new Parameters
        param.requires_grad_(name not in frozen)  # that forget they were frozen
    return TensorPlan(
        source=source,
        sequence_parallel=sp,
        linears=linears,
        replicated=replicated,
        whole_vocab=whole_vocab,
        moe_blocks=sum(moe_mlp(b) is not None for b in blocks),
    )


def _block_styles(
    block: nn.Module, plan: dict[str, str], *, sequence_parallel: bool
) -> dict[str, Any]:
    """The styles of one block: sequence parallelism's, its plan's linears and
    replicated modules, and a mixture-of-experts MLP's ([Note: experts under tensor
    parallelism] in fsdpkit.sharding.tensor.moe: its input is not gathered)."""
    styles: dict[str, Any] = sequence_parallel_styles(block) if sequence_parallel else {}
    if moe_mlp(block) is not None:
        styles.pop(MLP, None)
        styles.update(moe_styles(block, sequence_parallel=sequence_parallel))
    for name in block_entries(block, plan):
        if plan[name] == REPLICATED:
            block.get_submodule(name)  # a planned module the block lacks is an error
            styles[name] = replicated_grad_reduced()
        else:
            styles.update(
                _linear_plan(block, name, plan[name], sequence_parallel=sequence_parallel)
            )
    return styles
