"""How long FSDP2 and autograd keep a unit's gradients, where that is not simply
"until the reduce-scatter's copy-in": the rules the analytic replay
(fsdpkit.planner.replay.walk) asks at each unit's backward.

[Note: the last gradient]
FSDP2's ``foreach_reduce`` (torch 2.13, _fsdp_collectives.py) frees the unit's
unsharded gradients after the copy-in by clearing its list, but the loop before
it (``for i, (fsdp_param, unsharded_grad) in enumerate(zip(...))``, which
re-chunks gradients not sharded on dim 0) leaves its variable bound to the last
one, so the unit's last parameter's gradient (in FSDP2's order, the module's
``parameters()``) lives until ``foreach_reduce`` returns: through the
reduce-scatter output and gloo's clone of the input, where a bf16 step with an
fp32 reduce peaks. The loop runs only on a shard group of more than one rank.
Which parameter is last is the model's: the built-in Llama block ends with
``down_proj`` (d x f), transformers' with a norm weight (d), an untied head's
unit with the head (the whole vocabulary's rows, or the tp-local ones: "MP HL
hf llama tp2 x cp2" read +7.1% planned whole), the root without edge units
(``parallel.edge_units=false``) with the untied head too (V1 bf16 +AC, V3 rows
of bench/plan_accuracy.py). Without it the block units' reduce-scatter read
-1.0% ("T bf16 full"), -1.3% ("T bf16 chunked 48"), -0.9% ("ACC T bf16
accum=2 every"), -1.4% ("MP T bf16 tp2 x cp2") and -2.1% ("MP T bf16 dp2 x cp2
selective"). After no-sync micro-batches (``accum_sync = last``) it is the last
accumulated gradient, in the reduce dtype when FSDP2 accumulates in one of its
own ([Note: accumulating in place]); read from the code, not at any measured
row's peak.

[Note: accumulating in place]
After a no-sync micro-batch FSDP2 leaves each unsharded parameter's ``.grad``
where autograd put it when it is already in the reduce dtype
(``FSDPParam.to_accumulated_grad_if_needed`` moves it to an fp32 accumulator
only when the dtypes differ), so in the next micro-batch's backward autograd's
AccumulateGrad adds each new weight gradient into it in place and the new one
dies at once: that block's backward allocates no unit-sized gradients beside
the accumulated ones. Counting both read +0.7% to +1.0% with checkpointing
(bench/plan_accuracy.py's "... accum=2" rows at world 2 and 4, measured; the
peak sits in a block's backward of the last micro-batch) and +0.38% on "S full
accum=2"; now -0.06% to -0.02%. The new gradient still exists for a moment: the
matmul's backward node makes it with its input's gradient, releases what it saved
and hands its input's gradient on, and only then does AccumulateGrad (autograd's
next node) add it in and free it (``transient_grads``). A pipeline stage's
steady-state backward peaks there, at down_proj's node: the new d x f gradient
beside the f-wide input gradient (pp4's middle stages read -1.7% without it).
"""

from __future__ import annotations

from fsdpkit.planner.model.unit_layout import Unit
from fsdpkit.planner.replay.blocksizes import GRAD, Event, Sizes
from fsdpkit.planner.shapes.scenario import Scenario


def last_grad_bytes(*, sc: Scenario, s: Sizes, unit: Unit, accumulated: bool) -> int:
    """Bytes of ``unit``'s last gradient, alive through its reduce-scatter ([Note: the
    last gradient]); ``accumulated``: no-sync micro-batches left grads on the unit."""
    if sc.dims.fsdp_shard <= 1 or not unit.last_grad_numel:
        return 0
    separate = accumulated and s.e != sc.reduce_bytes
    return unit.last_grad_numel * (sc.reduce_bytes if separate else s.e)


def transient_grads(events: list[Event]) -> list[Event]:
    """A block's backward ``events`` when its weight gradients are summed into the
    accumulated ones in place ([Note: accumulating in place]): each new gradient
    (a GRAD event) dies once its node has released what it held (the frees right
    after it) — AccumulateGrad runs next."""
    out: list[Event] = []
    pending = 0
    for category, nbytes in events:
        if pending and nbytes > 0:
            out.append((GRAD, -pending))
            pending = 0
        out.append((category, nbytes))
        if category == GRAD:
            pending += nbytes
    return out + ([(GRAD, -pending)] if pending else [])


def grads_in_place(*, sc: Scenario, s: Sizes, accumulated: bool) -> bool:
    """Whether this backward sums its weight grads into the accumulated ones in place
    ([Note: accumulating in place])."""
    return accumulated and s.e == sc.reduce_bytes
