"""What ``recommend()`` returns: the configurations it planned, ranked.

Its own module so the report and the CLI read a recommendation without importing the
search (fsdpkit.planner.search.recommend).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpkit.config import RunConfig
from fsdpkit.planner.search.layouts import LayoutTry
from fsdpkit.planner.search.stepcost import StepCost
from fsdpkit.planner.shapes.result import Plan


@dataclass(frozen=True)
class Candidate:
    """One configuration of the search: what changes, its plan and its cost."""

    changes: dict[str, object]
    """Dotted config keys -> values that differ from the input config."""
    config: RunConfig
    plan: Plan
    cost: StepCost

    @property
    def fits(self) -> bool:
        return bool(self.plan.fits)


@dataclass(frozen=True)
class Recommendation:
    """The search result; ``best`` is None when nothing fits."""

    best: Candidate | None
    ranked: tuple[Candidate, ...]
    """Configurations that fit, cheapest first (at most ``top``)."""
    current: Candidate | None
    """The input configuration as given (None if it is invalid at this world size)."""
    cheaper_unfit: Candidate | None
    """The cheapest configuration that does not fit, if cheaper than ``best``."""
    considered: int
    """Configurations planned."""
    fitting: int
    searched: int = 0
    """Valid configurations in the search grid (more than ``considered`` when a traced
    model was planned cheapest first)."""
    layouts: tuple[LayoutTry, ...] = ()
    """The tp x cp layouts planned, fewest model-parallel ranks first, each with its
    closest candidate ([Note: layout search] in fsdpkit.planner.search.layouts)."""
