"""The model's edge modules: an untied input embedding and output head, each its own
FSDP unit.

[Note: edge units]
Left in the root unit, an untied embedding and head stay unsharded from the root's
pre-forward to the end of backward (the root is never resharded in between), and the
head's unsharded gradient waits for the root's reduce-scatter in backward's final
callback: for a large vocabulary that is three V x d tensors held through every
block's backward (2.94 GiB per rank for llama3-8b in bf16). As their own units (as
torchtitan shards them):

- the embedding unit is all-gathered for the embedding's forward and resharded after
  it (under a resharding strategy), gathered again only for its own backward, last;
- the head unit is all-gathered for the head's forward and kept unsharded until its
  backward, which comes first: its gradient is reduce-scattered right after the
  loss's backward, before any block's. It is never resharded after forward: backward
  needs it at once, and the chunked loss reads its gathered weight after the head's
  forward returned ([Note: the loss inside the root's forward] in
  fsdpkit.loss.head).

The final norm (the one norm with parameters outside the blocks) becomes a third, tiny
unit when the head has its own: FSDP2 keeps a unit's reduce-scatter input (the
head's unsharded gradient in the reduce dtype: V x d x 4 bytes, 1.96 GiB for
llama3-8b) alive until the next unit's post-backward; the norm's comes right after
the norm's backward, so the head's buffer is released before the last block's
backward instead of living through it. It costs one all-gather and one
reduce-scatter of d elements per micro-batch, and on a GPU the compute stream waits
for the head's reduce-scatter at that point instead of one block later.

A tied pair (one weight for both) stays in the root: the weight is needed at both
ends of forward and backward, so a unit of its own would save nothing. So does a
module inside a block, or one without parameters. The root keeps the rest (buffers,
and the final norm when there is no head unit).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fsdpkit.models.accessors import input_embeddings, is_norm, output_embeddings

EDGE_ROLES = ("embedding", "norm", "head")
"""Edge units in forward order."""


def edge_modules(
    model: nn.Module, *, blocks: Sequence[nn.Module], enabled: bool = True
) -> dict[str, nn.Module]:
    """The modules that get their own FSDP unit, by role ("embedding", "norm",
    "head"), in forward order: the model's ``get_input_embeddings()`` and
    ``get_output_embeddings()`` (or ``lm_head``), when untied, with parameters of their
    own and outside every block, and with such a head the final norm ([Note: edge
    units]); none unless ``enabled`` (``parallel.edge_units``)."""
    if not enabled:
        return {}
    pairs = (("embedding", input_embeddings(model)), ("head", output_embeddings(model)))
    found = {r: m for r, m in pairs if m is not None and m is not model}
    params = {role: {id(p) for p in m.parameters()} for role, m in found.items()}
    if len(params) == 2 and params["embedding"] & params["head"]:
        return {}  # tied
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    edges = {r: m for r, m in found.items() if params[r] and not params[r] & in_blocks}
    norm = _final_norm(model, inside=[*blocks, *edges.values()]) if "head" in edges else None
    if norm is not None:
        edges["norm"] = norm
    return {role: edges[role] for role in EDGE_ROLES if role in edges}


def _final_norm(model: nn.Module, *, inside: Sequence[nn.Module]) -> nn.Module | None:
    """The one norm layer with parameters outside ``inside`` (None if none or several)."""

    covered = {id(m) for unit in inside for m in unit.modules()}
    norms = [m for m in model.modules() if id(m) not in covered and is_norm(m)]
    return norms[0] if len(norms) == 1 else None
