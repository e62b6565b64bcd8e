"""How attention heads split over the tensor- and context-parallel ranks: the rules the
trainer checks a layout with before launch and the planner sizes attention by.

Pure functions of the head counts and degrees, kept apart from the exchanges that
apply them (fsdpkit.sharding.context.attention, fsdpkit.sharding.context.ring), so
that the planner and the launcher's checks do not import DTensor and the collectives.
"""

from __future__ import annotations

from fsdpkit.errors import ConfigError

CP_ATTENTION = {
    "ulysses": "Ulysses all-to-all",
    "ring": "ring attention, head-tail chunks",
}
"""How each ``parallel.cp_attention`` splits attention, for the run's first lines."""


def heads_cp(*, cp: int, attention: str) -> int:
    """The cp degree every tp rank's heads must divide by: cp under Ulysses, which
    splits heads over the cp ranks; 1 under ring attention, which keeps them whole."""
    return 1 if attention == "ring" else cp


def check_cp_heads(*, n_heads: int, cp: int, tp: int = 1) -> None:
    """ConfigError unless every tensor-parallel rank's query heads divide by cp ([Note:
    Ulysses context parallelism] in fsdpkit.sharding.context.attention); for validating a layout
    before launch."""
    if n_heads % tp or (n_heads // tp) % cp:
        raise ConfigError(
            f"parallel.cp = {cp} must divide the attention heads on each rank: the model "
            f"has {n_heads} query heads, {n_heads // max(tp, 1)} per rank at parallel.tp = "
            f"{tp}, and context parallelism gives each cp rank an equal share of them "
            "over the whole sequence. Choose a cp (and tp) whose product divides "
            f"{n_heads}."
        )


def kv_repeat(*, q_heads: int, kv_heads: int, cp: int) -> int:
    """The smallest repeat of the kv heads that divides by cp and into the q heads."""
    rep = q_heads // kv_heads
    return next(f for f in range(1, rep + 1) if rep % f == 0 and (kv_heads * f) % cp == 0)
