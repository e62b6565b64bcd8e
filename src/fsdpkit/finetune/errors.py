"""The fine-tuning section's one error type."""

from __future__ import annotations

from fsdpkit.errors import UserError


class FinetuneError(UserError):
    """``model.freeze`` or the ``[lora]`` section cannot be applied to this model; the
    message names the key, the pattern and what the model has instead."""
