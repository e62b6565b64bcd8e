"""Errors about the model a run trains."""

from fsdpkit.errors import UserError


class ModelError(UserError):
    """The model section names something that cannot be built."""
