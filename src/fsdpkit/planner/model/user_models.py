"""Models the planner did not write: ``model.hf`` directories and ``model.factory``.

[Note: planning any model]
The planner plans what ``fsdpkit train`` builds, so for these models it builds the run's
model exactly as the trainer does (``fsdpkit.models.factory.build_model``: an HF model
on meta with its constructor's buffers; a factory called as the trainer calls it), runs
``fsdpkit.finetune.prepare_model`` when the run freezes anything, and reads the units off it
(``layout_of``: the blocks ``shard()`` would pick). Parameter shapes, and so sharded
states, gradients, all-gather buffers and traffic, are then exact for any model.

Activations are not: they depend on the block's ops. The analytic model knows the ops
of one block family: a pre-norm Llama decoder layer (RMSNorm, RoPE, grouped-query SDPA,
SwiGLU). transformers' Llama and Mistral decoder layers run those ops, so an HF config
of that family without extras (biases, sliding windows, other activations) is planned
analytically with its shape read from config.json (``hf_llama_shape``); every other
model is planned by tracing its real code under fake tensors (fsdpkit.planner.traced.trace).
bench/plan_accuracy.py measures both against real runs (rows "H ...").

The build is cached per model-relevant config (the recommender plans many variants of
one run, and a factory may be slow).

[Note: transformers' Llama in the plan]
transformers' Llama / Mistral run the block's ops of the built-in Llama, but its body
holds some tensors differently, and the analytic plan of the same shape read up to
8.7% over the measured peak until these were modeled (``ModelLayout.transformers_body``;
bench/plan_accuracy.py "HL" rows, each cause found in the traced planner's op-by-op
ledger, which was exact on them):

- RoPE: no cos / sin tables (the built-in's are 2 x max_seq_len x head_dim fp32 for the
  whole run), only the inverse frequencies (``ModelLayout.buffer_bytes`` reads every
  model's buffers); the body computes cos and sin in every forward for its position
  ids, (1, seq, head_dim) in the compute dtype each, which every block's RoPE saves
  until the first block's backward (``rope_bytes(tables=False)``);
- attention: its sdpa path passes grouped-query k / v unrepeated with ``enable_gqa``
  when there is no mask (causal, unpacked rows) and head_dim <= 256
  (``use_gqa_in_sdpa``), so SDPA saves k and v at kv heads, and its backward makes
  their gradients there, with no repeated copies to sum (``Sizes.gqa``,
  fsdpkit.planner.replay.sizing.sdpa_gqa: 2 x (heads - kv) x head_dim x e bytes a token less than
  the built-in's ``repeat_interleave``; measured on the CPU kernel). Under cp fsdpkit's
  exchanges repeat them as for the built-in Llama;
- sequence parallelism: the embedding output stays whole and the first block's input
  is cut from it (fsdpkit.sharding.tensor.edges), and the body keeps the whole tensor
  (``inputs_embeds``) until its forward returns (fsdpkit.planner.replay.sizing.kept_embedding);
- RMSNorm: ``weight * x.to(dtype)`` casts the normalized input before the weight
  multiplies it, so in low precision it saves that cast (N x d x e) where the built-in
  saves the fp32 copy and an fp32 weight (``Sizes.norm_casts_first``; in fp32 both are
  the same: +3.0% on a bf16 "HL hf llama full" against the traced plan without it);
- its head is untied: the head unit's last gradient ([Note: the last gradient] in
  fsdpkit.planner.replay.gradlife) is the head's tp-local rows, not the whole vocabulary's.

The first two were +2.5% on "HL hf llama full" (the GQA copies 2.0%, the tables 0.5%),
the last +7.1% of the +8.7% on "MP HL hf llama tp2 x cp2"; the third is not at these
rows' peaks (it is at each block's forward), nor the fourth (they are fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from fsdpkit.config import RunConfig, with_changes
from fsdpkit.errors import UserError
from fsdpkit.loss.head import unsupported_reason
from fsdpkit.loss.router import RouterSpec, router_spec
from fsdpkit.models.accessors import input_vocab
from fsdpkit.models.experts import Experts, experts_of
from fsdpkit.models.factory import BuiltModel
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.planner.errors import PlanError
from fsdpkit.planner.model.unit_layout import ModelLayout, layout_of

ANALYTIC_HF_BLOCKS = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer"}
"""HF model types whose decoder layer runs the ops of the analytic block model, and the
layer class that must be the unit (a forced other class is traced)."""


@dataclass(frozen=True)
class BuiltPlanModel:
    """What the planner needs of a model built by the trainer's own builder."""

    layout: ModelLayout
    shape: LlamaConfig | None
    """Its Llama shape when the analytic model applies, else None (traced)."""
    why_traced: str | None
    """Why the analytic model does not apply (None when it does)."""
    vocab_size: int
    """Rows of its input embedding (token ids the traced step may draw)."""
    flops_per_token: float
    """Training FLOPs per token at the run's sequence length (step-time ranking)."""
    what: str
    """How the model is named in reports, e.g. "model.hf GPT2LMHeadModel"."""
    chunked_why_not: str | None = None
    """Why the chunked loss cannot replace this model's loss (None: it can; the
    trainer's own rule, fsdpkit.loss.head.unsupported_reason)."""
    experts: Experts | None = None
    """Its routed experts (None: dense)."""
    router: RouterSpec | None = None
    """Its router loss as the trainer adds it (None: no router)."""


def build_key(cfg: RunConfig, *, vocab: int | None, precision: str) -> tuple[object, ...]:
    """Everything the build and layout depend on."""
    return (
        repr(cfg.model),
        repr(cfg.lora),
        repr(cfg.parallel.block_classes),
        cfg.precision.norms_fp32,
        cfg.data.seq_len,
        cfg.train.seed,
        vocab,
        precision,
    )


def built_for_plan(
    cfg: RunConfig, *, vocab: int | None, precision: str, shape: LlamaConfig | None = None
) -> BuiltModel:
    """The run's model as the trainer builds and prepares it ([Note: one builder], step
    1), on meta, in the planned precision. Its layout does not depend on the loss (the
    scenario plans train.chunked_loss), so the build keeps full logits."""
    # here: the builder imports FSDP2 and DCP, which a preset's formulas never need
    from fsdpkit.trainable.build import build_unsharded

    planned = with_changes(cfg, {"precision.mode": precision, "train.chunked_loss": "off"})
    return build_unsharded(planned, vocab_size=vocab or 1, device_type="cpu", shape=shape).built


def planned_model(cfg: RunConfig, *, vocab: int | None, precision: str) -> BuiltPlanModel:
    """The layout (and, where it applies, the analytic shape) of a model.hf / factory
    model (see [Note: planning any model]); cached."""
    key = build_key(cfg, vocab=vocab, precision=precision)
    found = _CACHE.get(key)
    if found is None:
        found = _plan_model(cfg, vocab=vocab, precision=precision)
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = found
    return found


_CACHE: dict[tuple[object, ...], BuiltPlanModel] = {}


def _plan_model(cfg: RunConfig, *, vocab: int | None, precision: str) -> BuiltPlanModel:
    try:
        built = built_for_plan(cfg, vocab=vocab, precision=precision)
    except UserError as exc:
        raise PlanError(str(exc)) from None
    model = built.module
    layout = layout_of(model, class_names=cfg.parallel.block_classes or None)
    rows = input_vocab(model, default=vocab or 256)
    what = f"model.{'hf' if cfg.model.hf else 'factory'} {type(model).__name__}"
    hf_config = getattr(model, "config", None) if built.hf is not None else None
    shape, why = _analytic_shape(hf_config, layout=layout, seq_len=cfg.data.seq_len)
    if shape is not None:
        layout = replace(layout, decoder_blocks=True, transformers_body=True)
    experts = experts_of(model)
    if shape is not None:
        flops = shape.flops_per_token(cfg.data.seq_len)
    else:  # 6 per active parameter (fsdpkit.models.flops); attention needs the shape
        flops = 6.0 * (experts.active if experts else sum(p.numel() for p in model.parameters()))
    custom = built.loss_fn is not None
    return BuiltPlanModel(
        layout=layout,
        shape=shape,
        why_traced=None if shape else f"{what}: {why}",
        vocab_size=int(rows),
        flops_per_token=flops,
        what=what,
        chunked_why_not=unsupported_reason(model, custom_loss=custom),
        experts=experts,
        router=router_spec(model, coef=cfg.model.router_aux_loss_coef),
    )


def _analytic_shape(
    config: Any, *, layout: ModelLayout, seq_len: int
) -> tuple[LlamaConfig | None, str]:
    """(the Llama shape, "") when the analytic block model applies, else (None, why)."""
    if config is None:
        return None, "a factory module (the analytic model knows fsdpkit's and HF Llama blocks)"
    kind = getattr(config, "model_type", "?")
    block = ANALYTIC_HF_BLOCKS.get(kind)
    if block is None:
        return None, f"model_type {kind!r} (analytic: {', '.join(ANALYTIC_HF_BLOCKS)})"
    if layout.block_class != block:
        return None, f"units of {layout.block_class} rather than {block}"
    extra = _extras(config)
    if extra:
        return None, f"{kind} with {extra} (the analytic block model has none)"
    shape = hf_llama_shape(config, seq_len=seq_len)
    if shape is None:
        return None, f"{kind} with a head_dim other than hidden_size / heads"
    return shape, ""


def _extras(config: Any) -> str:
    """What an HF Llama-family config adds beyond the analytic block's ops ("" none)."""
    found = [
        name
        for name, value in (
            ("attention_bias", getattr(config, "attention_bias", False)),
            ("mlp_bias", getattr(config, "mlp_bias", False)),
            ("sliding_window", getattr(config, "sliding_window", None)),
            ("attention_dropout", getattr(config, "attention_dropout", 0.0)),
        )
        if value
    ]
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        found.append(f"hidden_act={act}")
    return ", ".join(found)


def hf_llama_shape(config: Any, *, seq_len: int) -> LlamaConfig | None:
    """The Llama shape of an HF Llama-family config (None: its head_dim differs from
    hidden_size / heads, which the built-in Llama cannot express)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim * heads != config.hidden_size:
        return None
    return LlamaConfig(
        vocab_size=config.vocab_size,
        dim=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        ffn_dim=config.intermediate_size,
        max_seq_len=max(seq_len, getattr(config, "max_position_embeddings", seq_len)),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        init_std=getattr(config, "initializer_range", 0.02),
        norm_eps=getattr(config, "rms_norm_eps", 1e-5),
        rope_theta=_rope_theta(config),
    )


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:  # transformers 5 keeps it in rope_parameters
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta) if theta and math.isfinite(float(theta)) else 10000.0
