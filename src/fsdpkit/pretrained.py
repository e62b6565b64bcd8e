"""Whether a module is a transformers ``PreTrainedModel``, without importing transformers.

A leaf, because both sides of the layer list ask: checkpoint/ (transformers' own key
conversions apply to its models only, fsdpkit.checkpoint.hf_convert) and everything from
models/ up (HF init on shards, the loss head, context-parallel attention, the router
loss), and checkpoint sits below models.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:  # typing only: transformers is never imported here
    from typing import TypeGuard

    from transformers import PreTrainedModel


def is_hf_model(module: nn.Module) -> TypeGuard[PreTrainedModel]:
    """Whether ``module`` is a transformers ``PreTrainedModel``. transformers is never
    imported here: a model of that class exists only once the user's code (or model.hf)
    imported it, so where it is not loaded the answer is no, at no cost."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)
