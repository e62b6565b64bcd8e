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
  in ``model.norm`` (the rule of fsdpkit.sharding.tensor_sequence) it gets sequence
  parallelism too: its body computes masks and positions from the embedding output's
  length, so the sequence is split at the first block's input instead of the
  embedding's output (fsdpkit.sharding.tensor_edges); other families keep the residual stream whole;
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

from fsdpkit.config import RunConfig
from fsdpkit.models.accessors import is_norm_class
from fsdpkit.models.errors import ModelError
from fsdpkit.models.experts import expert_field
from fsdpkit.models.hf import read_hf_dir
from fsdpkit.models.llama import Llama
from fsdpkit.models.presets import preset
from fsdpkit.sharding.context import check_cp_heads, heads_cp
from fsdpkit.sharding.tensor_edges import edges
from fsdpkit.sharding.tensor_sequence import sequence_parallel_applies, sequence_parallel_styles

LLAMA_BLOCK: dict[str, str] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
"""fsdpkit's block plan: module names of the built-in Llama and of transformers'
Llama, Mistral and Qwen2 decoder layers."""

REPLICATED = "replicated_with_grad_allreduce"
PLAN_KINDS = ("colwise", "rowwise", REPLICATED)
"""The ``base_model_tp_plan`` entries fsdpkit applies (the others are refused)."""


class TensorParallelError(ModelError):
    """The model cannot be split over ``parallel.tp`` ranks."""


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

    def describe(self, tp: int) -> str:
        sp = ", sequence parallel" if self.sequence_parallel else ""
        vocab = (
            "embedding and head split by vocabulary, loss parallel"
            if self.whole_vocab is None
            else f"embedding and head whole: {self.whole_vocab}"
        )  # no "; ": the run's first line joins its parts with it
        norms = f", {self.replicated} per-head norms replicated" if self.replicated else ""
        return (
            f"tensor parallel {tp} ({self.source}{sp}: {self.linears} linears split{norms}, "
            f"{vocab})"
        )


def block_plan(model: nn.Module, *, tp: int) -> tuple[dict[str, str], str]:
    """(module name in a block -> "colwise" / "rowwise", where it came from)."""
    if isinstance(model, Llama) and expert_field(model.config) is None:
        return dict(LLAMA_BLOCK), "fsdpkit's Llama plan"
    return _hf_block_plan(getattr(model, "config", None), name=type(model).__name__, tp=tp)


def _experts(config: Any) -> str | None:
    """``"FIELD = N"`` where ``config`` describes a mixture-of-experts model, else None.

    Read from the config (fsdpkit.models.experts), not from its ``base_model_tp_plan``:
    since transformers 5.25 Mixtral's and OLMoE's plans name only the attention
    projections (the experts moved to ``base_model_ep_plan``), and Qwen2-MoE's /
    Qwen3-MoE's name a dense ``mlp.gate_proj`` that their expert layers do not have.
    Such a plan would pass the entry check and fail only once the model is built,
    after the processes start.
    """
    found = expert_field(config)
    return f"{found[0]} = {found[1]}" if found else None


def _hf_block_plan(config: Any, *, name: str, tp: int) -> tuple[dict[str, str], str]:
    """A transformers config's ``base_model_tp_plan`` as a block plan, or the refusal
    naming the family, the field and the entries fsdpkit does not apply."""
    family = getattr(config, "model_type", None) or name
    experts = _experts(config)
    if experts:
        raise TensorParallelError(
            f"parallel.tp = {tp}: fsdpkit has no tensor-parallel plan for {name} ({family}): "
            f"it is a mixture-of-experts model ({experts} in its config), and fsdpkit splits "
            "dense blocks only (colwise / rowwise linears of transformers' "
            "base_model_tp_plan), not expert layers. Use parallel.tp = 1 (FSDP over all "
            "ranks; parallel.ep splits the experts, parallel.cp long sequences), or a dense "
            "model family."
        )
    hf_plan = getattr(config, "base_model_tp_plan", None) or {}
    translated = {k.split("layers.*.", 1)[1]: v for k, v in hf_plan.items() if "layers.*." in k}
    others = [f"{k}: {v}" for k, v in hf_plan.items() if "layers.*." in k and v not in PLAN_KINDS]
    splits = any(v != REPLICATED for v in translated.values())
    if splits and not others:
        return translated, f"transformers' base_model_tp_plan of {name}"
    has = (
        "has no entries for its layers"
        if not translated
        else f"has entries fsdpkit does not apply ({', '.join(others[:4])})"
    )
    raise TensorParallelError(
        f"parallel.tp = {tp}: fsdpkit has no tensor-parallel plan for {name} ({family}): its "
        f"config's base_model_tp_plan {has}. fsdpkit applies colwise / rowwise linears and "
        "replicated_with_grad_allreduce per-head norms (Llama, Mistral, Qwen2, Qwen3, Gemma2, "
        "Gemma3, ...), not the gathered outputs of OLMo2 / OLMo3 (q / k norms over the "
        "whole hidden q / k) or of the fused projections of Phi3 and GLM, nor "
        "mixture-of-experts layers. Use parallel.tp = 1 (FSDP over all ranks; parallel.cp "
        "splits long sequences instead), or a model family with such a plan."
    )


def check_layout(cfg: RunConfig) -> None:
    """Refuse a tp / cp layout the configured model cannot take, from the config alone
    (the launcher calls this before any process starts). A factory model is checked
    when it is built, before the process group starts."""
    p, m = cfg.parallel, cfg.model
    if (p.tp == 1 and p.cp == 1) or m.factory:
        return
    if m.hf:
        config = read_hf_dir(m.hf).config
        if p.tp > 1:
            _hf_block_plan(config, name=type(config).__name__, tp=p.tp)
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
    else:
        shape = preset(m.preset)
        if p.tp > 1 and expert_field(shape) is not None:
            raise TensorParallelError(
                f"parallel.tp = {p.tp}: model.preset = {m.preset} is a mixture-of-experts "
                "model, and fsdpkit splits dense blocks only, not expert layers. Use "
                "parallel.tp = 1 and parallel.ep to split the experts over the data ranks "
                "(parallel.cp splits long sequences)."
            )
        heads, kv = m.n_heads or shape.n_heads, m.n_kv_heads or shape.n_kv_heads
    check_heads(
        n_heads=heads, n_kv_heads=kv, tp=p.tp, cp=heads_cp(cp=p.cp, attention=p.cp_attention)
    )


def check_heads(*, n_heads: int, n_kv_heads: int, tp: int, cp: int = 1) -> None:
    """Heads must split evenly over tp, and each tp rank's query heads over cp
    (fsdpkit.sharding.context.check_cp_heads, the context-parallel rule)."""
    for name, heads in (("attention heads", n_heads), ("key/value heads", n_kv_heads)):
        if heads % tp:
            raise TensorParallelError(
                f"parallel.tp = {tp} does not divide the model's {heads} {name}: every "
                f"tensor-parallel rank computes an equal share of them. Use a tp that "
                f"divides {heads}."
            )
    if cp > 1:
        check_cp_heads(n_heads=n_heads, cp=cp, tp=tp)


def model_heads(model: nn.Module) -> tuple[int, int]:
    """(attention heads, key/value heads) of the built-in Llama or a transformers model."""
    config = getattr(model, "config", None)
    if isinstance(model, Llama):
        return model.config.n_heads, model.config.n_kv_heads
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        raise TensorParallelError(
            f"parallel.tp / parallel.cp: {type(model).__name__} does not say how many "
            "attention heads it has (config.num_attention_heads); fsdpkit splits only models "
            "that do. Use parallel.tp = 1 and parallel.cp = 1."
        )
    return heads, getattr(config, "num_key_value_heads", None) or heads


def check_model(
    model: nn.Module, *, tp: int, cp: int = 1, blocks: list[nn.Module] | None = None
) -> tuple[dict[str, str], str]:
    """The model's block plan (at tp > 1) after checking its heads split over tp and cp
    and that it covers every parameter of ``blocks`` but their norms (``check_covered``);
    ``build_unsharded`` calls it before any process group starts."""
    plan, source = block_plan(model, tp=tp) if tp > 1 else ({}, "")
    for block in blocks if tp > 1 and blocks else []:
        check_covered(block, plan, tp=tp)
    n_heads, n_kv = model_heads(model)
    check_heads(n_heads=n_heads, n_kv_heads=n_kv, tp=tp, cp=cp)
    return plan, source


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


def check_covered(block: nn.Module, plan: dict[str, str], *, tp: int) -> None:
    """Refuse a block whose plan leaves parameters inside it unplanned (Apertus' xIELU
    activation, between up and down; an attention the plan does not split): with heads
    and hidden units split around them, their gradients would be partial sums no one
    reduces over tp. Only the block's own norms (whole hidden states) may be unplanned."""
    covered = tuple(f"{name}." for name in plan)
    norms = tuple(f"{n}." for n, m in block.named_children() if is_norm_class(m))
    stray = [n for n, _ in block.named_parameters() if not n.startswith(covered + norms)]
    if stray:
        raise TensorParallelError(
            f"parallel.tp = {tp}: the tensor-parallel plan of {type(block).__name__} leaves "
            f"{len(stray)} parameter(s) inside its split layers unplanned "
            f"({', '.join(stray[:3])}); their gradients would differ between the tp ranks. "
            "Use parallel.tp = 1 for this model (FSDP over all ranks)."
        )


def tensor_parallel(
    model: nn.Module, *, mesh: DeviceMesh, blocks: list[nn.Module], cp: int = 1
) -> TensorPlan:
    """Split ``model``'s blocks over the tp ``mesh`` ([Note: tensor-parallel plans]),
    in place; call before activation checkpointing and FSDP2. ``cp``: the degree the
    heads per tp rank must divide by (fsdpkit.sharding.context.heads_cp)."""
    tp = mesh.size()
    plan, source = check_model(model, tp=tp, cp=cp, blocks=blocks)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    sp = sequence_parallel_applies(model, blocks=blocks)
    linears = [n for n, kind in plan.items() if kind != REPLICATED]
    for block in blocks:
        styles: dict[str, Any] = sequence_parallel_styles(block) if sp else {}
        for name in linears:
            styles.update(_linear_plan(block, name, plan[name], sequence_parallel=sp))
        for name in plan.keys() - set(linears):
            block.get_submodule(name)  # a planned module the block lacks is an error
            styles[name] = replicated_grad_reduced()
        parallelize_module(block, mesh, styles)
    first = blocks[0] if sp and not isinstance(model, Llama) else None
    whole_vocab = edges(model, mesh=mesh, sequence_parallel=sp, first_block=first)
    for name, param in model.named_parameters():  # SequenceParallel makes new Parameters
        param.requires_grad_(name not in frozen)  # that forget they were frozen
    return TensorPlan(
        source=source,
        sequence_parallel=sp,
        linears=len(linears) * len(blocks),
        replicated=(len(plan) - len(linears)) * len(blocks),
        whole_vocab=whole_vocab,
    )
