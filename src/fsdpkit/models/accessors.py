"""Where a model keeps its input embedding and its output head: Hugging Face's accessor
names (``get_input_embeddings`` / ``get_output_embeddings``, which fsdpkit's Llama
has too), else an ``lm_head`` attribute for the head. One lookup for edge units, the
chunked loss, the planner's layout and its vocabulary."""

from __future__ import annotations

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
