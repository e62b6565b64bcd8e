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
- a transformers model: its config's ``base_model_tp_plan`` (colwise / rowwise
  entries of ``layers.*.NAME``), else fsdpkit's plan where its blocks have the
  Llama / Mistral / Qwen2 module names. Where its blocks and final norm have those
  names (``SEQUENCE_PARALLEL_MODULES``, ``model.norm``) it gets sequence parallelism
  too: its body computes masks and positions from the embedding output's length, so
  the sequence is split at the first block's input instead of the embedding's output
  (fsdpkit.sharding.tensor_edges); other families keep the residual stream whole;
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

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdpkit.config import RunConfig
from fsdpkit.models.errors import ModelError
from fsdpkit.models.hf import read_hf_dir
from fsdpkit.models.llama import Llama, preset
from fsdpkit.sharding.context import check_cp_heads, heads_cp
from fsdpkit.sharding.tensor_edges import edges

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
    whole_vocab: str | None = None
    """Why the embedding and head were not split by vocabulary (None: they were)."""

    def describe(self, tp: int) -> str:
        sp = ", sequence parallel" if self.sequence_parallel else ""
        vocab = (
            "embedding and head split by vocabulary, loss parallel"
            if self.whole_vocab is None
            else f"embedding and head whole: {self.whole_vocab}"
        )  # no "; ": the run's first line joins its parts with it
        return f"tensor parallel {tp} ({self.source}{sp}: {self.linears} linears split, {vocab})"


def block_plan(model: nn.Module, *, tp: int) -> tuple[dict[str, str], str]:
    """(module name in a block -> "colwise" / "rowwise", where it came from)."""
    if isinstance(model, Llama):
        return dict(LLAMA_BLOCK), "fsdpkit's Llama plan"
    return _hf_block_plan(getattr(model, "config", None), name=type(model).__name__, tp=tp)


def _hf_block_plan(config: Any, *, name: str, tp: int) -> tuple[dict[str, str], str]:
    """A transformers config's ``base_model_tp_plan`` as a block plan, or the refusal."""
    hf_plan = getattr(config, "base_model_tp_plan", None) or {}
    translated = {k.split("layers.*.", 1)[1]: v for k, v in hf_plan.items() if "layers.*." in k}
    if translated and all(v in ("colwise", "rowwise") for v in translated.values()):
        return translated, f"transformers' base_model_tp_plan of {name}"
    has = "none" if not hf_plan else f"entries it does not apply: {sorted(set(hf_plan.values()))}"
    raise TensorParallelError(
        f"parallel.tp = {tp}: fsdpkit has no tensor-parallel plan for {name}. It splits the "
        "built-in Llama and transformers models whose config has a colwise/rowwise "
        f"base_model_tp_plan (Llama, Mistral, Qwen2, ...); this one has {has}. Use "
        "parallel.tp = 1 (FSDP over all ranks; parallel.cp splits long sequences instead), "
        "or a model family with a plan."
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


def check_model(model: nn.Module, *, tp: int, cp: int = 1) -> tuple[dict[str, str], str]:
    """The model's block plan (at tp > 1) after checking its heads split over tp and cp;
    ``build_unsharded`` calls it before any process group starts."""
    plan, source = block_plan(model, tp=tp) if tp > 1 else ({}, "")
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


SEQUENCE_PARALLEL_MODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
"""A block's submodules sequence parallelism lays out (Llama / Mistral / Qwen2 names)."""


def sequence_parallel_names(names: Iterable[str]) -> bool:
    """Whether a block with these parameter names has the submodules sequence
    parallelism lays out (the trainer's and the planner's rule)."""
    names = list(names)
    return all(any(n.startswith(f"{m}.") for n in names) for m in SEQUENCE_PARALLEL_MODULES)


def sequence_parallel_applies(model: nn.Module, *, blocks: list[nn.Module]) -> bool:
    """Whether fsdpkit splits the norms and residual stream by sequence: the built-in
    Llama, and transformers models whose blocks and final norm have the Llama names."""
    if isinstance(model, Llama):
        return True
    named = all(sequence_parallel_names(n for n, _ in b.named_parameters()) for b in blocks)
    return named and isinstance(getattr(getattr(model, "model", None), "norm", None), nn.Module)


def _sequence_parallel_block(*, builtin: bool) -> dict[str, ParallelStyle]:
    """The norms and module inputs of a block under sequence parallelism: the norms on
    the sequence shard, each attention / MLP input gathered whole (plain tensors, for
    a replicated lora_A). The built-in attention takes (x, cos, sin, mask); a
    transformers one ``hidden_states=`` (its other arguments are whole already)."""
    gather = {"desired_input_layouts": (Replicate(),), "use_local_output": True}
    if builtin:
        attn = PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        )
    else:
        attn = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        )
    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": attn,
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), **gather),
    }


def tensor_parallel(
    model: nn.Module, *, mesh: DeviceMesh, blocks: list[nn.Module], cp: int = 1
) -> TensorPlan:
    """Split ``model``'s blocks over the tp ``mesh`` ([Note: tensor-parallel plans]),
    in place; call before activation checkpointing and FSDP2. ``cp``: the degree the
    heads per tp rank must divide by (fsdpkit.sharding.context.heads_cp)."""
    tp = mesh.size()
    plan, source = check_model(model, tp=tp, cp=cp)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    builtin = isinstance(model, Llama)
    sp = sequence_parallel_applies(model, blocks=blocks)
    linears = 0
    for block in blocks:
        styles: dict[str, Any] = _sequence_parallel_block(builtin=builtin) if sp else {}
        for name, kind in plan.items():
            styles.update(_linear_plan(block, name, kind, sequence_parallel=sp))
            linears += 1
        parallelize_module(block, mesh, styles)
    first = blocks[0] if sp and not builtin else None
    whole_vocab = edges(model, mesh=mesh, sequence_parallel=sp, first_block=first)
    for name, param in model.named_parameters():  # SequenceParallel makes new Parameters
        param.requires_grad_(name not in frozen)  # that forget they were frozen
    return TensorPlan(source=source, sequence_parallel=sp, linears=linears, whole_vocab=whole_vocab)
