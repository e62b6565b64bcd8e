"""The data pipeline's one error type."""

from __future__ import annotations

from fsdpkit.errors import UserError


class DataError(UserError, ValueError):
    """The data or tokenizer the config points at cannot be used; the message names the
    config field or file at fault and says how to fix it."""
