"""The zero-bubble schedules' split backward in the planner's event model: a block's
backward as torch's input pass and weight pass hold memory.

[Note: zero-bubble backward]
torch 2.13's zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)
run a stage's backward as two actions (torch.distributed.pipelining._backward):

- I (``stage_backward_input``): ``autograd.grad`` towards the stage's input only,
  with ``retain_graph=True``, while a pre-hook on every node that leads to a weight
  keeps that node's incoming gradient. No weight gradient is made, no saved tensor
  is freed (the graph is retained), and what a weight's gradient is made from stays:
  each matmul's output gradient and each norm weight product's (the events marked
  ``ForWeights``). Since those hold the residual stream's gradient too (down_proj's
  is the block's output gradient, o_proj's the sum after the MLP), neither of a
  block's two residual sums can happen in place: each makes a new tensor.
- W (``stage_backward_weight``): ``autograd.grad`` from the kept gradients to the
  weights, one parameter after another in the module's order (the block's forward
  order: each weight's gradient, then what its node held, freed); the weight
  gradients are made (summed into the accumulated ones in place
  after the first micro-batch: ``transient_grads``), and the graph, with everything
  the input pass kept, is freed: the saved tensors, the kept gradients and the two
  residual gradients the input pass could not reuse (of which a pipeline stage's
  receive buffer, its last block's output gradient, persists).

The first stage has no input gradient to make: torch skips its input pass and its
weight pass runs the whole backward. On the last stage the final norm splits as a
block's norms do, and so does an unchunked head (its logits' gradient is what its
weight's gradient is made from). The chunked loss (fsdpkit.loss.chunked_ce) is one
autograd node that makes the hidden states' and the head weight's gradients
together: the input pass runs it whole and drops the weight's gradient, the weight
pass runs it whole again (recomputing the logits chunks) and drops the hidden
states' gradient; what it saved, and the head's input, live until then. FSDP2's
post-backward bookkeeping of the head and final norm units follows their weight
gradients into the weight pass. Measured on a tiny Llama (bench/plan_accuracy.py's
"ZBVZeroBubble pp2 x dp2" row, the test in
tests/distributed/test_planner_pipeline_accuracy.py): with I and W replayed as one
backward at I, the rank holding the middle stages read -1.8% of its real peak.
"""

from __future__ import annotations

import functools

from fsdpkit.planner.replay.blockmem import block_backward, block_recompute, selective_backward_end
from fsdpkit.planner.replay.blocksizes import ACT, GRAD, TEMP, Event, ForWeights, Sizes
from fsdpkit.planner.replay.gradlife import transient_grads
from fsdpkit.planner.replay.headmem import chunked_loss_saved
from fsdpkit.planner.replay.ledger import EventSummary, summarize


def split_events(events: list[Event]) -> tuple[list[Event], list[Event]]:
    """(input pass, weight pass) of a head's or final norm's backward ``events``."""
    return (
        [e for e in events if not _weight_pass_frees(e)],
        [e for e in events if _weight_pass_frees(e)],
    )


def split_chunked_loss(events: list[Event], *, s: Sizes) -> tuple[list[Event], list[Event]]:
    """(input pass, weight pass) of the chunked loss's node (``chunked_loss_backward``):
    run whole in both, the head weight's gradient dropped by the first, the hidden
    states' gradient (its first event) by the second."""
    saved = chunked_loss_saved(s)
    run = events[: len(events) - len(saved)]
    assert events[len(run) :] == saved, "chunked_loss_backward ends with what it saved"
    grads = sum(n for c, n in run if c == GRAD)
    return [*run, (GRAD, -grads)], [*run, (TEMP, -s.nde), *saved]


def _weight_pass_frees(event: Event) -> bool:
    """Whether the weight pass, not the input pass, does this event."""
    category, nbytes = event
    return category == GRAD or (nbytes < 0 and (category == ACT or isinstance(nbytes, ForWeights)))


@functools.cache
def split_backward(
    s: Sizes,
    *,
    recompute: bool,
    sdpa_workspace: int,
    selective: bool,
    in_place: bool,
    received: bool,
    weight_grads: bool = True,
    fresh: bool = False,
) -> tuple[EventSummary, EventSummary]:
    """(input pass, weight pass) of one block's backward ([Note: zero-bubble backward]);
    the arguments as ``fsdpkit.planner.replay.walk._backward_summary``'s. A frozen
    block's (``weight_grads=False``: LoRA's base) weight pass makes no weight gradient
    of its own; its adapters' are added by the caller, and what their gradients are
    made from (each adapted matmul's output gradient: every linear's under LoRA's
    default all-linear targets) is kept as for a trained block."""
    inputs = block_recompute(s, selective=selective) if recompute else []
    per_weight: list[list[Event]] = [[]]  # from each weight's gradient to the next one's
    for event in block_backward(s, sdpa_workspace=sdpa_workspace, held=2, fresh=fresh):
        if not _weight_pass_frees(event):
            inputs.append(event)
            continue
        if event[0] == GRAD:
            per_weight.append([])
        per_weight[-1].append(event)
    weights = [e for part in reversed(per_weight) for e in part]  # the parameters' order
    weights += [(TEMP, -s.nde)] * (1 if received else 2)  # the residual sums' summands
    if s.adapters:  # each lora_A's output gradient, what its weight's is made from
        inputs.append((TEMP, s.adapters))
        weights.append((TEMP, -s.adapters))
    if recompute and selective:
        weights += selective_backward_end(s)
    if recompute and s.cast:
        weights.append((ACT, -s.nde))  # the checkpointed input
    if not weight_grads:
        weights = [(c, n) for c, n in weights if c != GRAD]
    elif in_place:
        weights = transient_grads(weights)
    return summarize(inputs), summarize(weights)
