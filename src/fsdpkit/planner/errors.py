"""The planner's errors: what it cannot plan, and a model whose code failed in a trace."""

from fsdpkit.errors import UserError


class PlanError(UserError, ValueError):
    """The planner cannot plan this input; the message names the field."""


class TraceError(PlanError):
    """The model's own code failed while the traced planner ran one fake step."""
