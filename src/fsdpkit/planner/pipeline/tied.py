"""The planner's view of a tied embedding and head under pipeline parallelism.

[Note: tied stages in the plan]
Under pp the trainer gives the first stage the embedding (a stage without the head:
an edge unit of its own) and the last stage a copy as its head, in its root ([Note:
tied embeddings across stages] in fsdpkit.sharding.pipeline.tied). Each is planned as
the real run holds it: the first stage's embedding backward is an untied one's; the
last stage holds the copy with its gradient and optimizer state, and sums one step's
gradient into the copy's right after the head's backward (its weight pass goes first
in a zero-bubble W: the copy's weight carries the embedding's name, the stage's first
parameter); a rank that holds both ends (a V schedule) steps the first copy only (no
optimizer state for the other, whose gradient goes before the step). The two ends'
ranks all-reduce the copy's gradient once per step (its sharded elements, fp32).
"""

from __future__ import annotations

from dataclasses import replace

from fsdpkit.planner.model.unit_layout import ModelLayout
from fsdpkit.planner.shapes.result import CommVolume
from fsdpkit.planner.shapes.scenario import Scenario


def tied_index(layout: ModelLayout) -> int | None:
    """Where a tied embedding and head's weight lies in ``layout.root`` (a tied model
    has no edge units: fsdpkit.sharding.edges); None when untied."""
    if any(e.role in ("embedding", "head") for e in layout.edges):
        return None
    rows = layout.embedding_rows
    return next((i for i, (r, c) in enumerate(layout.root) if r == rows and c > 1), None)


def _copy_elements(sc: Scenario, first: Scenario) -> int:
    """The sharded elements of one copy of the tied weight (0 when untied)."""
    embedding = first.edge("embedding")
    if tied_index(sc.layout) is None or embedding is None:
        return 0
    return embedding.trainable_sharded


def twin_elements(sc: Scenario, stages: dict[int, Scenario], *, local: list[int]) -> int:
    """The sharded elements of the tied copy a rank holding both the first and the
    last stage does not step; 0 otherwise. ``stages``: every stage's scenario."""
    last = max(stages)
    if 0 not in local or last not in local:
        return 0
    return _copy_elements(sc, stages[0])


def with_tie_all_reduce(
    comm: CommVolume, sc: Scenario, stages: dict[int, Scenario], *, local: list[int]
) -> CommVolume:
    """``comm`` plus the tied gradient's all-reduce where the rank holds one end only
    (two ranks: each sends its copy's gradient once)."""
    ends = {0, max(stages)} & set(local)
    if len(ends) != 1:
        return comm
    grad = 4 * _copy_elements(sc, stages[0])
    if not grad:
        return comm
    return replace(comm, all_reduce=comm.all_reduce + grad, calls=comm.calls + 1)
