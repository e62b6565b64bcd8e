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
ranks' identical gradients (x ranks), which FSDP's mean over the ranks divides back,
as for the gather (fsdpkit.loss.router scales it under tp). Every rank of ``group``
holds its own tokens (data, context- and tensor-parallel ranks alike: under tp each
routes its own tokens), and the sums run over all of them (the whole world, or one
pipeline stage's ranks).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist


def summed(t: torch.Tensor, *, grad: bool, group: Any = None) -> torch.Tensor:
    """``t`` summed over ``group``'s ranks (None: every rank), with autograd through the
    sum when ``grad``."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    if not grad:
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t
    from torch.distributed.nn import all_reduce

    with warnings.catch_warnings():  # deprecated in name; funcol's has no gloo backward
        warnings.simplefilter("ignore", FutureWarning)
        return all_reduce(t, group=group or dist.group.WORLD)


def _layer_sums(layer: torch.Tensor, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each expert's summed router probability, with autograd; its top-k assignments)
    of one layer's logits [tokens, experts]."""
    p = torch.softmax(layer.float(), dim=-1)
    chosen = torch.topk(p.detach(), top_k, dim=-1).indices.reshape(-1)
    ones = torch.ones_like(chosen, dtype=torch.float32)  # not bincount: data-sized
    return p.sum(dim=0), ones.new_zeros(experts).index_add_(0, chosen, ones)


def aux_of(
    probs: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor, experts: int
) -> torch.Tensor:
    """``A = E x sum_e (C_e / N) (S_e / N)`` from the global sums."""
    return experts * torch.sum((counts / rows) * (probs / rows))


def balance_loss(
    logits: tuple[torch.Tensor, ...], experts: int, top_k: int, *, group: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A of the global micro-batch, each layer's expert shares [layers, experts]) from
    this rank's router ``logits`` ([tokens, experts] per layer), summed over ``group``
    (None: every rank), [Note: the balance loss from sums]."""
    sums = [_layer_sums(layer, experts, top_k) for layer in logits]
    counts = torch.stack([c for _, c in sums])
    rows = sum(x.shape[0] for x in logits)
    local = torch.cat([counts.reshape(-1), counts.new_tensor([rows])])
    total = summed(local, grad=False, group=group)
    per_layer, n = total[:-1].reshape(len(logits), experts), total[-1]
    p_sum = summed(torch.stack([p for p, _ in sums]).sum(dim=0), grad=True, group=group)
    aux = aux_of(p_sum, per_layer.sum(dim=0), n, experts)
    shares = per_layer / per_layer.sum(dim=1, keepdim=True).clamp(min=1)
    return aux, shares


def routing_sums(logits: list[torch.Tensor], experts: int, top_k: int) -> torch.Tensor:
    """[2 E + 1]: this rank's ``S_e`` (with autograd), ``C_e`` and ``N`` over the
    layers of ``logits`` ([tokens, experts] each): all that ``A`` needs of them, which a
    pipeline stage adds to the sums it received and sends on ([Note: the router loss
    across stages] in fsdpkit.sharding.pipeline.routing)."""
    sums = [_layer_sums(x.reshape(-1, experts), experts, top_k) for x in logits]
    rows = sum(x.numel() // experts for x in logits)
    probs = torch.stack([p for p, _ in sums]).sum(dim=0)
    counts = torch.stack([c for _, c in sums]).sum(dim=0)
    return torch.cat([probs, counts, counts.new_tensor([rows])])


def aux_of_sums(sums: torch.Tensor, experts: int, *, group: Any = None) -> torch.Tensor:
    """``A`` of the global micro-batch from ``routing_sums`` (every layer's, this
    rank's), summed over ``group``."""
    probs = summed(sums[:experts], grad=True, group=group)
    rest = summed(sums[experts:].detach(), grad=False, group=group)
    return aux_of(probs, rest[:experts], rest[experts], experts)
