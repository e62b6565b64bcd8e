"""pp in the recommender ([Note: pipeline in the recommender]): the degrees it tries,
what it varies at each, and how pp changes its step estimate."""

from __future__ import annotations

from fsdpkit.planner.replay.sizing import hidden_bytes
from fsdpkit.planner.shapes.scenario import Scenario

PIPELINE_GRID: tuple[dict[str, object], ...] = tuple(
    {"parallel.strategy": strategy, "activations.mode": ac}
    for strategy in ("full", "grad_op")
    for ac in ("none", "full")
)
"""What the recommender varies at each pipeline degree (the data-parallel settings
that matter most with pp; gradients always accumulate without sync under pp)."""


PIPELINE_DEGREES = (2, 4, 8, 16, 32, 64)
"""pp degrees the recommender tries (where they split the nodes evenly)."""


def pipeline_degrees(*, world: int, per_node: int) -> list[int]:
    """The pp degrees the recommender tries ([Note: pipeline in the recommender]): the
    ``PIPELINE_DEGREES`` that split the nodes into equal groups of whole nodes, so the
    pipeline is the axis that crosses nodes (every stage's tp and cp stay inside a
    node). None on one node."""
    nodes = world // per_node if per_node and world % per_node == 0 else 1
    return [pp for pp in PIPELINE_DEGREES if pp <= nodes and nodes % pp == 0]


def pipeline_cost(sc: Scenario) -> tuple[float, float, int]:
    """[Note: pipeline in the recommender]
    How pp changes the recommender's step estimate: each rank computes 1 / pp of the
    layers, stretched by the 1F1B bubble (pp - 1) / (n + pp - 1); its FSDP traffic is
    its stage's, 1 / pp of the model's, over the stage's ranks (inside a node when a
    stage is whole nodes); and it sends each micro-batch's hidden state and gradient
    across the node boundary (``p2p_bytes``), on the critical path. Returns (compute
    factor, traffic factor, p2p bytes per rank); (1, 1, 0) without pp.

    The recommender tries pp at every tp x cp layout it searches, at the degrees that
    split the nodes evenly (``pipeline_degrees``). Its layouts go fewest model-parallel
    ranks first and the first that fits wins ([Note: layout search]), unless the
    fastest fitting candidate so far waits on its collectives (its traffic takes longer
    than its compute, as FSDP's all-gathers over a slow network between nodes do): then
    the larger tp layouts, with pp across the nodes and FSDP inside them, are planned
    too and the estimated step time chooses."""
    if sc.dims.pp == 1:
        return 1.0, 1.0, 0
    n = sc.grad_accum
    bubble = (sc.dims.pp - 1) / (n + sc.dims.pp - 1)
    hidden = hidden_bytes(sc)
    return 1.0 / (sc.dims.pp * (1.0 - bubble)), 1.0 / sc.dims.pp, 2 * n * hidden
