"""The layout of a fine-tuned built-in Llama: frozen parameters, LoRA adapters, the base's
dtype.

``finetune_layout`` builds the run's model on meta and applies what the trainer applies
before sharding (``fsdpkit.finetune.prepare_model``: peft adapters in their blocks,
``model.freeze``, ``lora.base_dtype``), then reads its layout: the adapters are
parameters of their block units, and every parameter carries whether it trains. The
analytic model then plans

- sharded parameters: 4 bytes per trainable element (the fp32 master), the stored
  dtype's bytes per frozen one (2 for a bf16 base);
- gradients, reduce-scatter buffers and AdamW states (8 bytes per element) for the
  trainable parameters only; a unit without any only reshards after backward;
- no weight gradient for a frozen output head or embedding.

Activations are planned as for full training, plus LoRA's rank-r intermediates
(``ModelLayout.adapter_width``); blocks frozen *before* the first trainable one save
nothing, and the first block after them starts the graph (``fresh`` in
fsdpkit.planner.replay.blockmem); frozen blocks that still backpropagate save no
linear's input for a weight gradient (``Sizes.frozen_linears``). The traced planner
runs ``prepare`` on the traced model too and sees all of it.
"""

from __future__ import annotations

from fsdpkit.config import RunConfig
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.planner.model.unit_layout import ModelLayout, layout_of
from fsdpkit.planner.model.user_models import built_for_plan


def finetuned(cfg: RunConfig) -> bool:
    """Whether the run freezes anything (LoRA or model.freeze)."""
    return bool(cfg.lora.rank or cfg.model.freeze)


def finetune_layout(cfg: RunConfig, shape: LlamaConfig, *, precision: str) -> ModelLayout:
    """The layout of the built-in Llama of ``shape`` as the run prepares it (cached on
    what ``prepare`` reads: the recommendation search plans many variants)."""
    key = (
        repr(cfg.lora),
        repr(cfg.model.freeze),
        repr(cfg.parallel.block_classes),
        cfg.precision.norms_fp32,
    )
    found = _CACHE.get((key, shape, precision))
    if found is None:
        model = built_for_plan(cfg, vocab=shape.vocab_size, precision=precision, shape=shape)
        found = layout_of(model.module, class_names=cfg.parallel.block_classes or None)
        if len(_CACHE) > 64:
            _CACHE.clear()
        _CACHE[(key, shape, precision)] = found
    return found


_CACHE: dict[tuple[object, ...], ModelLayout] = {}
