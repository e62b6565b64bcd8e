"""Token dispatch of a routed experts module: the capacity rule and expert parallelism's
all-to-all, around the module's own forward.

[Note: token dispatch]
An experts module (transformers' fused layout, and the built-in MoE model's, which
has its interface: ``forward(hidden [T, d], top_k_index [T, k], top_k_weights [T,
k])``, fsdpkit.models.moe) gets ``ExpertDispatch`` as its forward when a run sets
``parallel.ep`` > 1 or ``model.capacity_factor``:

1. capacity (optional): each rank keeps at most ``ceil(factor x T x k / E)`` of its
   own assignments per expert, first come first served in token order; a dropped
   assignment gets the index ``E`` (transformers' "no expert" sentinel) and weight 0,
   so the token keeps its other experts and the residual. Decided on each rank's own
   tokens before any exchange, so a run drops the same assignments at every ep degree,
   and counts them (``drops``: the step's metrics say ``moe_dropped``).
2. without ep: the module's own forward on all of them;
3. with ep: the assignments sorted by expert (stable: token order inside an expert);
   the per-expert counts exchanged (one ``all_to_all_single`` of E integers, so every
   rank knows what it receives: the only host sync), the rows sent to the ep ranks
   holding their experts and the outputs returned with ``all_to_all_single`` with
   autograd (variable sizes: no token dropped, no padding); each rank runs the
   module's own forward over its ``E / ep`` experts' weights (the local shard of the
   DTensor, fsdpkit.sharding.experts.parallel; under tp a rank's own tokens, [Note:
   replicated weights, split tokens] in fsdpkit.sharding.replicated), every received
   row with weight 1; back on
   the source rank the rows are weighted and summed over the token's k experts, as
   transformers' kernels do.

[Note: routing imbalance]
Under ep a rank computes the rows the whole ep group routed to its experts, which the
router decides: a balanced step gives each rank its own tokens x k rows, a skewed one
more to some ranks. Each dispatch keeps, from the received counts it already holds on
the host (step 3's sync: no extra communication), every training call's received rows
/ its own tokens x k (the balanced rows); ``loads`` gives per layer (mean over the
calls: micro-batches, and a checkpointed block's recompute, which repeats its
forward's counts) and the largest call. The step's metrics reduce that over the ranks
(fsdpkit.loss.router): ``moe_imbalance`` is the busiest rank's received rows over the
MoE layers / balanced, ``moe_imbalance_layer_max`` its busiest layer's. Both size what
a rank holds (all layers' rows before backward, one recomputed layer's with
checkpointing), which the planner can plan at ([Note: routing in the plan] in
fsdpkit.planner.experts.routing).

The backward mirrors it: the all-to-alls' backward sends each row's gradient back to
the rank that computed it; an expert's weight gradient sums the rows of every ep rank,
and FSDP divides by all data ranks (fsdpkit.sharding.experts.parallel), so a rank's gradients
equal one process's on the global batch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol

from fsdpkit.sharding.replicated import LocalParams


def over_capacity(index: torch.Tensor, *, experts: int, factor: float) -> torch.Tensor:
    """Which assignments ([T, k] bool) exceed their expert's capacity ``ceil(factor x T
    x k / E)``, first come first served in token order ([Note: token dispatch])."""
    tokens, k = index.shape
    capacity = math.ceil(factor * tokens * k / experts)
    ids, order = torch.sort(index.reshape(-1), stable=True)
    ones = torch.ones_like(ids)
    counts = ones.new_zeros(experts).index_add_(0, ids, ones)
    starts = counts.cumsum(0) - counts
    place = torch.arange(ids.numel(), device=ids.device) - starts[ids]
    return (
        torch.empty_like(place, dtype=torch.bool)
        .index_copy_(0, order, place >= capacity)
        .view(tokens, k)
    )


def _in_the_graph(out: torch.Tensor, *, rows: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``out`` tied to the received ``rows`` and the local experts by a zero term.

    [Note: a rank that receives no rows]
    When the router sends none of a step's assignments to a rank's experts, that rank
    computes on zero rows. transformers' grouped-GEMM experts (their default) and the
    built-in model stay in the autograd graph then, but the eager expert loop
    (``experts_implementation="eager"``) returns a fresh zero tensor outside it
    (checked on Qwen3-MoE, transformers 5): the rank would skip the backward of both
    all-to-alls its peers enter, which then wait on it, and its experts would get no
    gradient for FSDP's reduce-scatter. The zero term keeps both exchanges and every
    local expert in the backward (gradients of zeros) whatever the family's forward
    does. tests/distributed/test_expert_dispatch_empty.py trains such steps.
    """
    touch = rows.sum() + sum(p.sum() for p in module.parameters())
    return out + 0 * touch.to(out.dtype)


class ExpertDispatch:
    """The forward of one experts module ([Note: token dispatch])."""

    def __init__(
        self,
        module: nn.Module,
        *,
        experts: int,
        group: dist.ProcessGroup | None,
        capacity_factor: float | None,
    ) -> None:
        self.module = module
        self.own_forward = type(module).forward
        self.experts = experts
        self.group = group
        self.ep = dist.get_world_size(group) if group is not None else 1
        self.capacity_factor = capacity_factor
        self._drops: torch.Tensor | None = None
        """Dropped and routed assignments since the last ``drops()`` (on the device)."""
        self._loads: list[float] = []
        """Received rows / balanced rows of each training call since the last ``loads()``."""

    def __call__(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.capacity_factor:
            top_k_index, top_k_weights = self._capacity(top_k_index, top_k_weights)
        if self.group is None:  # under tp: the weights' local tensors
            with LocalParams(self.module):
                return self.own_forward(self.module, hidden, top_k_index, top_k_weights)
        return self._exchange(hidden, top_k_index, top_k_weights)

    def _capacity(
        self, index: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        drop = over_capacity(index, experts=self.experts, factor=self.capacity_factor or 0.0)
        if not self.module.training:  # the step's metrics count training steps only
            return index.masked_fill(drop, self.experts), weights.masked_fill(drop, 0.0)
        with torch.no_grad():
            counted = torch.stack([drop.sum(), torch.ones_like(drop).sum()]).float()
            self._drops = counted if self._drops is None else self._drops + counted
        return index.masked_fill(drop, self.experts), weights.masked_fill(drop, 0.0)

    def _exchange(
        self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = index.shape
        group = self.group
        assert group is not None  # __call__ exchanges only with an ep group
        ids, order = torch.sort(index.reshape(-1), stable=True)
        ones = torch.ones_like(ids)
        counts = ones.new_zeros(self.experts + 1).index_add_(0, ids, ones)[: self.experts]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        send, recv, local_index = self.routes(counts, received, assignments=tokens * k)
        if self.module.training and tokens:  # [Note: routing imbalance]
            self._loads.append(sum(recv) / (tokens * k))
        kept = order[: sum(send)]  # dropped assignments (index E) sort last: not sent
        rows = funcol.all_to_all_single_autograd(hidden[kept // k], recv, send, group)
        unit = torch.ones(local_index.shape, dtype=hidden.dtype, device=hidden.device)
        with LocalParams(self.module):
            out = self.own_forward(self.module, rows, local_index, unit)
            if not rows.shape[0]:  # [Note: a rank that receives no rows]
                out = _in_the_graph(out, rows=rows, module=self.module)
        back = funcol.all_to_all_single_autograd(out, send, recv, group)
        per = back.new_zeros(tokens * k, back.shape[-1]).index_copy(0, kept, back)
        summed = (per.view(tokens, k, per.shape[-1]) * weights.unsqueeze(-1).to(per.dtype)).sum(
            dim=1
        )
        return summed.to(hidden.dtype)

    def routes(
        self, counts: torch.Tensor, received: torch.Tensor, *, assignments: int
    ) -> tuple[list[int], list[int], torch.Tensor]:
        """(rows sent to each ep rank, rows received from each, the local expert of
        every received row [rows, 1]) from this rank's per-expert ``counts`` (of its
        ``assignments``) and the ``received`` counts of its own experts from every
        rank: the dispatch's one host sync (the traced planner routes a balanced step
        here instead, having no values: [Note: expert parallelism in the plan])."""
        local = self.experts // self.ep
        send = counts.view(self.ep, local).sum(dim=1).tolist()
        recv = received.view(self.ep, local).sum(dim=1).tolist()
        experts_of_rows = torch.arange(local, device=counts.device).repeat(self.ep)
        return send, recv, experts_of_rows.repeat_interleave(received).unsqueeze(-1)

    def calls(self) -> list[float]:
        """The received rows / balanced rows of each training call since the last
        reset, this rank's, in order (not reset)."""
        return list(self._loads)

    def loads(self, *, reset: bool = True) -> tuple[float, float] | None:
        """(mean, largest) received rows / balanced rows of the training calls since
        the last reset, this rank's ([Note: routing imbalance]; None: none)."""
        out = self._loads
        if reset:
            self._loads = []
        return (sum(out) / len(out), max(out)) if out else None

    def drops(self) -> torch.Tensor | None:
        """(dropped, routed) assignments since the last call, this rank's (None: no
        capacity, or none routed); reset."""
        out, self._drops = self._drops, None
        return out
