"""The router's load-balancing loss over the global batch from per-expert sums: what
the built-in MoE model (fsdpkit.models.moe) adds to its objective.

[Note: the balance loss from sums]
transformers' ``load_balancing_loss_func`` (Switch Transformer eqs. 4-6) is

    A = E x sum_e f_e P_e,   f_e = C_e / N,   P_e = S_e / N

with ``C_e`` the top-k assignments to expert ``e``, ``S_e`` the sum of its router
probabilities and ``N`` the rows, each summed over every layer and token of the batch.
Only the three sums are global, so each rank sums its own tokens and one all-reduce of
``E + 1`` counts (no gradient) and one of ``E`` probability sums (with autograd) give
every rank the one-process ``A`` of the global micro-batch: a few numbers per layer,
whatever the world size, where gathering the router logits
(fsdpkit.loss.router, [Note: the router loss over the global batch]) sends every
rank's tokens x experts values to every rank. The all-reduce's backward sums the
ranks' identical gradients (x world), which FSDP's mean over the ranks divides back,
as for the gather. Every rank must hold its own tokens (tp refuses MoE models), and
the sums run over the whole world (data and context-parallel ranks alike).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def _summed(t: torch.Tensor, *, grad: bool) -> torch.Tensor:
    """``t`` summed over every rank (autograd through the sum when ``grad``)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    if not grad:
        t = t.clone()
        dist.all_reduce(t)
        return t
    from torch.distributed.nn import all_reduce

    with warnings.catch_warnings():  # deprecated in name; funcol's has no gloo backward
        warnings.simplefilter("ignore", FutureWarning)
        return all_reduce(t)


def balance_loss(
    logits: tuple[torch.Tensor, ...], experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A of the global micro-batch, each layer's expert shares [layers, experts]) from
    this rank's router ``logits`` ([tokens, experts] per layer), [Note: the balance loss
    from sums]."""
    counts, probs = [], []
    for layer in logits:
        p = torch.softmax(layer.float(), dim=-1)
        chosen = torch.topk(p.detach(), top_k, dim=-1).indices.reshape(-1)
        ones = torch.ones_like(chosen, dtype=torch.float32)  # not bincount: data-sized
        counts.append(ones.new_zeros(experts).index_add_(0, chosen, ones))
        probs.append(p.sum(dim=0))
    rows = sum(x.shape[0] for x in logits)
    local = torch.cat([torch.stack(counts).reshape(-1), counts[0].new_tensor([rows])])
    total = _summed(local, grad=False)
    per_layer, n = total[:-1].reshape(len(logits), experts), total[-1]
    p_sum = _summed(torch.stack(probs).sum(dim=0), grad=True)
    aux = experts * torch.sum((per_layer.sum(dim=0) / n) * (p_sum / n))
    shares = per_layer / per_layer.sum(dim=1, keepdim=True).clamp(min=1)
    return aux, shares
