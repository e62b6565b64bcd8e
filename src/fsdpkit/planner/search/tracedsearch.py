"""Which candidates the recommender traces for a model the analytic planner cannot
replay, and in which order.

[Note: traced search]
A traced candidate costs seconds (a deep built-in model: two shallow traces, [Note:
depth extrapolation]), the analytic grid has thousands, so a traced model's search is
smaller and ordered so that a failure rules others out:

- for a mixture-of-experts model the grid keeps what changes its memory most:
  parallel.ep, activation checkpointing (none, selective, full), the micro-batch, and
  FSDP over all data ranks or HSDP over one node (no other hybrid degrees, resharding
  variants, offload, or ``every`` accumulation);
- candidates that differ only in ``activations.mode`` (a ladder) are traced cheapest
  first, which is least recomputed first, until one fits: the rest of the ladder
  recompute more, so they hold less and cost more, and are not traced;
- ladders are taken cheapest first (estimated step time of their cheapest rung) until
  ``top`` candidates fit.

Other traced models (model.hf, factories) keep the whole grid with the ladder rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
C = TypeVar("C")


def moe_grid(changes: dict[str, Any], *, per_node: int) -> bool:
    """Whether a candidate's changes stay in a mixture-of-experts model's traced grid."""
    strategy = changes.get("parallel.strategy")
    hybrid_node = strategy == "hybrid" and changes.get("parallel.shard_degree") == per_node
    return (
        (strategy == "full" or hybrid_node)
        and changes.get("parallel.reshard_after_forward") is None
        and not changes.get("offload.params")
        and changes.get("parallel.accum_sync", "last") == "last"
        and changes.get("activations.mode") in ("none", "selective", "full")
    )


def ladders(
    options: Sequence[T], *, changes: Callable[[T], dict[str, Any]], cost: Callable[[T], Any]
) -> list[list[T]]:
    """``options`` grouped by everything but ``activations.mode``, each group cheapest
    first, the groups by their cheapest."""
    groups: dict[tuple[Any, ...], list[T]] = {}
    for o in options:
        key = tuple(sorted((k, repr(v)) for k, v in changes(o).items() if k != "activations.mode"))
        groups.setdefault(key, []).append(o)
    return sorted((sorted(g, key=cost) for g in groups.values()), key=lambda g: cost(g[0]))


def search(
    groups: list[list[T]], plan: Callable[[T], C], fits: Callable[[C], bool], *, top: int
) -> list[C]:
    """Each ladder's rungs planned until one fits; until ``top`` fit in all."""
    out: list[C] = []
    for ladder in groups:
        for option in ladder:
            out.append(plan(option))
            if fits(out[-1]):
                break
        if sum(fits(c) for c in out) >= top:
            break
    return out
