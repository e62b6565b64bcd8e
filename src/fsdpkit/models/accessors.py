"""Where a model keeps its input embedding, its output head and its norms: Hugging
Face's accessor names (``get_input_embeddings`` / ``get_output_embeddings``, which
fsdpkit's Llama has too), else an ``lm_head`` attribute for the head; a norm is any
LayerNorm / *Norm with parameters. One lookup for edge units, the chunked loss,
norms_fp32, the frozen base, the planner's layout and its vocabulary."""

from __future__ import annotations

import torch
from torch import nn


def _called(model: nn.Module, name: str) -> nn.Module | None:
    get = getattr(model, name, None)
    try:
        found = get() if callable(get) else None
    except NotImplementedError:  # transformers' answer for a model without that module
        return None
    return found if isinstance(found, nn.Module) else None


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """The token embedding (``get_input_embeddings()``), or None."""
    return _called(model, "get_input_embeddings")


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The output head (``get_output_embeddings()``, else ``lm_head``), or None."""
    head = _called(model, "get_output_embeddings")
    lm_head = getattr(model, "lm_head", None)
    if head is None and isinstance(lm_head, nn.Module):
        return lm_head
    return head


def is_norm_class(module: nn.Module) -> bool:
    """A norm layer, with or without parameters: an ``nn.LayerNorm`` (subclasses such as
    Nemotron's ``LayerNorm1P`` too) or a class named ``*Norm`` (``RMSNorm``,
    ``LlamaRMSNorm``, OLMo's parameter-free ``OlmoLayerNorm``): a per-token op over the
    last dim (what sequence parallelism may run on a sequence shard)."""
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("Norm")


def is_norm(module: nn.Module) -> bool:
    """A norm layer with its own parameters (LayerNorm, *Norm): own fp32 units under
    precision.norms_fp32; kept fp32 beside a bf16 frozen base (fsdpkit.finetune)."""
    return is_norm_class(module) and any(True for _ in module.parameters(recurse=False))


def input_vocab(model: nn.Module, *, default: int) -> int:
    """Token ids the model embeds: its input embedding's rows (HF's
    ``get_input_embeddings``, else the first ``nn.Embedding``), else ``default``."""
    embed = input_embeddings(model)
    if embed is None:
        embed = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    weight = getattr(embed, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else default
