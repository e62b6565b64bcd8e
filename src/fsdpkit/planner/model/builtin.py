"""The built-in models as the planner sees them: the shape ``fsdpkit train`` builds
for ``model.preset`` and what the planner needs of it (its layout, the analytic block
model or, for the mixture-of-experts presets, the traced one), beside model.hf and
factory models (fsdpkit.planner.model.user_models), all as ``BuiltPlanModel``."""

from __future__ import annotations

import functools

import torch

from fsdpkit.config import RunConfig
from fsdpkit.errors import UserError
from fsdpkit.loss.router import RouterSpec, router_spec
from fsdpkit.models.experts import Experts, experts_of
from fsdpkit.models.factory import llama_shape
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.models.presets import PRESETS, builtin_model, is_moe
from fsdpkit.planner.errors import PlanError
from fsdpkit.planner.model.finetune_layout import finetune_layout, finetuned
from fsdpkit.planner.model.unit_layout import llama_layout
from fsdpkit.planner.model.user_models import BuiltPlanModel, planned_model

BYTE_VOCAB = 256
"""The byte-level tokenizer's vocabulary: what a run without data.tokenizer trains on."""
MOE_TRACED = "the built-in MoE model's routed experts (the analytic block model is dense)"


def model_shape(cfg: RunConfig, *, vocab_size: int | None = None) -> LlamaConfig:
    """The Llama shape ``fsdpkit train`` builds for the built-in model of ``cfg``
    (fsdpkit.models.factory; model.hf / model.factory: fsdpkit.planner.model.user_models).

    Train takes the vocabulary from model.vocab_size, else from the tokenizer; pass the
    tokenizer's size as ``vocab_size``. Without either, the preset's vocabulary is
    planned (a note says so), which is what a real run of a preset needs anyway.
    """
    m = cfg.model
    if m.preset not in PRESETS:
        raise PlanError(
            f"model.preset = {m.preset!r} is not a built-in preset; choose one of "
            f"{', '.join(PRESETS)}."
        )
    vocab = vocab_size or PRESETS[m.preset].vocab_size
    try:
        return llama_shape(m, vocab_size=vocab, seq_len=cfg.data.seq_len)
    except UserError as exc:
        raise PlanError(str(exc)) from None


@functools.lru_cache(maxsize=16)
def _census(shape: LlamaConfig) -> tuple[Experts | None, RouterSpec | None]:
    """The routed experts and router loss of a built-in MoE shape (built on meta once:
    the recommender plans hundreds of variants of one shape)."""
    with torch.device("meta"):
        model = builtin_model(shape)
    return experts_of(model), router_spec(model, coef=None)


def selective_why_traced(cfg: RunConfig) -> str | None:
    """Selective checkpointing saves every other matmul's output: LoRA adapters add
    matmuls inside the blocks and shift which ones, which the analytic block model
    ([Note: selective block memory]) does not replay; the traced planner runs the
    policy itself."""
    if cfg.activations.mode == "selective" and cfg.lora.rank > 0:
        return "selective checkpointing of blocks with LoRA adapters"
    return None


def planned_builtin(cfg: RunConfig, *, vocab: int | None, precision: str) -> BuiltPlanModel:
    """The model ``fsdpkit train`` builds for ``cfg``, as the planner needs it: the
    built-in Llama from its shape, anything else built on meta by the trainer's own
    builder ([Note: planning any model])."""
    if cfg.model.hf or cfg.model.factory:
        return planned_model(cfg, vocab=vocab or BYTE_VOCAB, precision=precision)
    shape = model_shape(cfg, vocab_size=vocab)
    if finetuned(cfg):  # frozen parameters and adapters (fsdpkit.planner.model.finetune_layout)
        layout = finetune_layout(cfg, shape, precision=precision)
    else:
        layout = llama_layout(shape, tuple(cfg.parallel.block_classes))
    why = None if layout.decoder_blocks else f"units of {layout.block_reason}"
    experts = router = None
    if is_moe(shape):  # [Note: planning any model]: the real routed block, traced
        why = MOE_TRACED
        experts, router = _census(shape)
    return BuiltPlanModel(
        layout=layout,
        shape=shape,
        why_traced=why,
        vocab_size=shape.vocab_size,
        flops_per_token=shape.flops_per_token(cfg.data.seq_len),
        what="",
        experts=experts,
        router=router,
    )
