"""Which layouts tensor parallelism can give a model: each block's plan (which linears
split by columns, which by rows), the heads' split over tp and cp, whether the norms
and residual stream split by sequence, whether the embedding and head split by
vocabulary ([Note: tensor-parallel plans] in fsdpkit.sharding.tensor.plans).

These are the rules the launcher checks a layout with before any process starts, the
trainer applies (fsdpkit.sharding.tensor.plans, tensor_sequence, tensor_edges) and the
planner sizes a plan by. They read configs and module trees only, so checking or
planning a layout imports neither DTensor nor the collectives.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fsdpkit.config import RunConfig
from fsdpkit.loss.head import output_head
from fsdpkit.models.accessors import input_embeddings, is_norm_class, output_embeddings
from fsdpkit.models.errors import ModelError
from fsdpkit.models.experts import ROUTED_COMPONENT, expert_field
from fsdpkit.models.hf.directory import read_hf_dir
from fsdpkit.models.llama import Llama
from fsdpkit.models.presets import preset
from fsdpkit.sharding.heads import check_cp_heads, heads_cp
from fsdpkit.sharding.stage_edges import StageInput, StageOutput

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

MOE_BLOCK: dict[str, str] = {
    **{k: v for k, v in LLAMA_BLOCK.items() if k.startswith("self_attn.")},
    "self_attn.q_norm": "replicated_with_grad_allreduce",
    "self_attn.k_norm": "replicated_with_grad_allreduce",
}
"""The built-in MoE model's attention plan (Qwen3's per-head q / k norms); its MLP is
a mixture-of-experts block ([Note: experts under tensor parallelism] in
fsdpkit.sharding.tensor.moe)."""

REPLICATED = "replicated_with_grad_allreduce"
PLAN_KINDS = ("colwise", "rowwise", REPLICATED)
"""The ``base_model_tp_plan`` entries fsdpkit applies (the others are refused)."""


class TensorParallelError(ModelError):
    """The model cannot be split over ``parallel.tp`` ranks."""


def block_plan(model: nn.Module, *, tp: int) -> tuple[dict[str, str], str]:
    """(module name in a block -> "colwise" / "rowwise" / replicated, where it came
    from). A mixture-of-experts block's MLP is not in it: fsdpkit's own rule splits
    that ([Note: experts under tensor parallelism] in fsdpkit.sharding.tensor.moe)."""
    if isinstance(model, Llama):
        if expert_field(model.config) is None:
            return dict(LLAMA_BLOCK), "fsdpkit's Llama plan"
        return dict(MOE_BLOCK), "fsdpkit's MoE plan"
    return _hf_block_plan(getattr(model, "config", None), name=type(model).__name__, tp=tp)


def _experts(config: Any) -> str | None:
    """``"FIELD = N"`` where ``config`` describes a mixture-of-experts model, else None.

    Read from the config (fsdpkit.models.experts), not from its ``base_model_tp_plan``:
    since transformers 5.25 Mixtral's and OLMoE's plans name only the attention
    projections (the experts moved to ``base_model_ep_plan``), and Qwen2-MoE's /
    Qwen3-MoE's name a dense ``mlp.gate_proj`` that their expert layers do not have
    (only their dense layers, ``mlp_only_layers``). fsdpkit takes such a plan's
    attention (and dense-MLP) entries and splits the expert layers by its own rule.
    """
    found = expert_field(config)
    return f"{found[0]} = {found[1]}" if found else None


def _hf_block_plan(config: Any, *, name: str, tp: int) -> tuple[dict[str, str], str]:
    """A transformers config's ``base_model_tp_plan`` as a block plan, or the refusal
    naming the family, the field and the entries fsdpkit does not apply."""
    family = getattr(config, "model_type", None) or name
    hf_plan = getattr(config, "base_model_tp_plan", None) or {}
    translated = {k.split("layers.*.", 1)[1]: v for k, v in hf_plan.items() if "layers.*." in k}
    others = [f"{k}: {v}" for k, v in hf_plan.items() if "layers.*." in k and v not in PLAN_KINDS]
    splits = any(v != REPLICATED for v in translated.values())
    experts = _experts(config)
    if splits and not others:
        what = "" if experts is None else " (attention; experts by fsdpkit's MoE rule)"
        return translated, f"transformers' base_model_tp_plan of {name}{what}"
    has = (
        "has no entries for its layers"
        if not translated
        else f"has entries fsdpkit does not apply ({', '.join(others[:4])})"
    )
    moe = (
        f" It is a mixture-of-experts model ({experts} in its config): fsdpkit splits its "
        "expert layers itself but takes the attention's split from that plan."
        if experts
        else ""
    )
    raise TensorParallelError(
        f"parallel.tp = {tp}: fsdpkit has no tensor-parallel plan for {name} ({family}): its "
        f"config's base_model_tp_plan {has}.{moe} fsdpkit applies colwise / rowwise linears "
        "and replicated_with_grad_allreduce per-head norms (Llama, Mistral, Qwen2, Qwen3, "
        "Gemma2, Gemma3, Mixtral, Qwen2-MoE, Qwen3-MoE, ...), not the gathered outputs of "
        "OLMo2 / OLMo3 / OLMoE (q / k norms over the whole hidden q / k) or of the fused "
        "projections of Phi3 and GLM. Use parallel.tp = 1 (FSDP over all ranks; parallel.cp "
        "splits long sequences instead"
        + (", parallel.ep the experts" if experts else "")
        + "), or a model family with such a plan."
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
    (fsdpkit.sharding.heads.check_cp_heads, the context-parallel rule)."""
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


def check_covered(block: nn.Module, plan: dict[str, str], *, tp: int) -> None:
    """Refuse a block whose plan leaves parameters inside it unplanned (Apertus' xIELU
    activation, between up and down; an attention the plan does not split): with heads
    and hidden units split around them, their gradients would be partial sums no one
    reduces over tp. Only the block's own norms (whole hidden states) may be unplanned,
    and a mixture-of-experts MLP, which fsdpkit's own rule covers whole (``moe_mlp``)."""
    covered = tuple(f"{name}." for name in block_entries(block, plan))
    norms = tuple(f"{n}." for n, m in block.named_children() if is_norm_class(m))
    moe = moe_mlp(block)
    if moe is not None:
        loose = [n for n, _ in moe.named_parameters(recurse=False)]
        if loose:
            raise TensorParallelError(
                f"parallel.tp = {tp}: the mixture-of-experts MLP of {type(block).__name__} "
                f"holds parameters of its own ({', '.join(loose[:3])}) besides its router, "
                "experts and shared experts: fsdpkit cannot tell whether they act per "
                "token. Use parallel.tp = 1 for this model (FSDP over all ranks; "
                "parallel.ep splits its experts)."
            )
        norms += (f"{MLP}.",)
    stray = [n for n, _ in block.named_parameters() if not n.startswith(covered + norms)]
    if stray:
        raise TensorParallelError(
            f"parallel.tp = {tp}: the tensor-parallel plan of {type(block).__name__} leaves "
            f"{len(stray)} parameter(s) inside its split layers unplanned "
            f"({', '.join(stray[:3])}); their gradients would differ between the tp ranks. "
            "Use parallel.tp = 1 for this model (FSDP over all ranks)."
        )


def moe_mlp(block: nn.Module) -> nn.Module | None:
    """The block's mixture-of-experts MLP: its child ``mlp`` holding a routed experts
    child (``experts``, fsdpkit.models.experts); None for a dense block."""
    mlp = block._modules.get(MLP)
    if mlp is None or not isinstance(mlp._modules.get(ROUTED_COMPONENT), nn.Module):
        return None
    return mlp


def block_entries(block: nn.Module, plan: dict[str, str]) -> list[str]:
    """The entries of ``plan`` that ``block`` takes: all of them, but a mixture-of-experts
    block's MLP (a family's dense-MLP entries name its dense layers only)."""
    if moe_mlp(block) is None:
        return list(plan)
    return [n for n in plan if not n.startswith(f"{MLP}.")]


# [Note: sequence parallel blocks]
# A block takes sequence parallelism when its direct children are its attention
# (``self_attn``), its MLP (``mlp``) and norms only (fsdpkit.models.accessors.
# is_norm_class), whatever the norms are called or where they sit: Llama's two pre-norms,
# Gemma2 / Gemma3's four (pre- and post-attention, pre- and post-feedforward),
# Exaone4's post-norms.
# Between those children a block only adds, scales and normalizes per token, so the
# residual stream can hold seq / tp tokens per rank; every norm runs on its shard, and
# the attention's and the MLP's inputs are gathered whole (the row-parallel o / down
# reduce-scatter their outputs back: fsdpkit.sharding.tensor.plans). The model must also end
# in a final norm ``model.norm`` (run on the shard too). A block with any other child
# (a dropout, AltUp, a per-layer embedding) keeps the residual stream whole.
#
# Read in transformers 5.24 for each family the rule admits (the Llama-named ones, and
# Gemma, Gemma2, Gemma3, Qwen3, Exaone4, Cohere, Granite, OLMo,
# VaultGemma, ...; those of them trained against one process at 5.25 are listed in
# docs/parallelism.md): every block calls ``self_attn(hidden_states=...)`` and
# ``mlp(hidden_states)``; the gather takes the first positional argument or
# ``hidden_states=`` either way. ``EXCLUDED`` names the families whose model body
# changes the residual stream's length between blocks, which a split stream cannot
# follow.

ATTENTION, MLP = "self_attn", "mlp"
"""The two children of a block whose inputs sequence parallelism gathers."""

EXCLUDED: dict[str, str] = {
    "gemma4_unified_text": "its body slices the hidden states before its KV-sharing layers",
}
"""transformers ``model_type`` -> why its blocks keep the residual stream whole although
their children match."""


def sequence_parallel_block(block: nn.Module) -> bool:
    """Whether ``block``'s direct children are ``self_attn``, ``mlp`` and norms only."""
    children = dict(block.named_children())
    others = [m for n, m in children.items() if n not in (ATTENTION, MLP)]
    has_both = ATTENTION in children and MLP in children
    return has_both and bool(others) and all(is_norm_class(m) for m in others)


def sequence_parallel_applies(model: nn.Module, *, blocks: list[nn.Module]) -> bool:
    """Whether fsdpkit splits ``model``'s norms and residual stream by sequence under
    tensor parallelism (the trainer's and the planner's rule): every block passes
    ``sequence_parallel_block``, the model ends in ``model.norm`` and its family is
    not ``EXCLUDED``."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    final = getattr(getattr(model, "model", None), "norm", None)
    return (
        bool(blocks)
        and model_type not in EXCLUDED
        and isinstance(final, nn.Module)
        and (is_norm_class(final) or _norm_on_a_later_stage(model, final))
        and all(sequence_parallel_block(b) for b in blocks)
    )


def _norm_on_a_later_stage(model: nn.Module, final: nn.Module) -> bool:
    """A pipeline stage before the last: its final norm is an ``nn.Identity`` and its head
    a ``StageOutput`` ([Note: stage modules] in fsdpkit.sharding.pipeline.parts); the
    last stage holds the real norm, so every stage decides as the whole model does."""
    head = output_embeddings(model)
    return isinstance(final, nn.Identity) and isinstance(head, StageOutput)


def vocab_refusal(
    *, plain_embedding: bool, plain_head: bool, vocab: int, embedding_rows: int, tp: int
) -> str | None:
    """Why the embedding and head stay whole over tp; None: both split by vocabulary
    rows. The trainer and the planner ask this."""
    if not plain_embedding:
        return "the input embedding is not a plain nn.Embedding"
    if not plain_head:
        return "the output head is not a plain nn.Linear (a LoRA-wrapped head?)"
    if vocab % tp or embedding_rows != vocab:
        return f"the vocabulary ({vocab} rows) does not split evenly over tp = {tp}"
    return None


def vocab_parallel_refusal(model: nn.Module, *, tp: int) -> str | None:
    """``vocab_refusal`` for ``model``'s embedding and head (those a pipeline stage
    holds: [Note: stage modules] in fsdpkit.sharding.pipeline.parts)."""
    embedding, head = edge_pair(model)
    plain = output_head(model) if head is not None else None
    rows = getattr(getattr(embedding, "weight", None), "shape", (0,))[0]
    return vocab_refusal(
        plain_embedding=embedding is None or type(embedding) is nn.Embedding,
        plain_head=head is None or plain is not None,
        vocab=plain.weight.shape[0] if plain is not None else rows,
        embedding_rows=rows if embedding is not None else (plain.weight.shape[0] if plain else 0),
        tp=tp,
    )


def edge_pair(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The input embedding and the output head, which every model split over tp has
    (the tied-head and chunked-loss checks found them before); None for the one a
    pipeline stage leaves to another stage (its ``StageInput`` / ``StageOutput``)."""
    embedding, head = input_embeddings(model), output_embeddings(model)
    if embedding is None or head is None:
        raise ValueError(
            f"{type(model).__name__} has no input embedding or no output head "
            "(get_input_embeddings / get_output_embeddings) for tensor parallelism to lay out."
        )
    return (
        None if isinstance(embedding, StageInput) else embedding,
        None if isinstance(head, StageOutput) else head,
    )
