"""Communication per rank per optimizer step: what FSDP2 all-gathers and reduces.

Volumes are the bytes each rank sends (and receives) with ring-style algorithms:
an all-gather or reduce-scatter of a buffer of B bytes over G ranks moves
B*(G-1)/G per rank, an all-reduce 2*B*(G-1)/G. Per micro-batch every unit is
all-gathered before its forward unless it is still unsharded, and again before its
backward if it was resharded after forward (an int ``reshard_after_forward`` k
all-gathers within k ranks). Gradients are reduce-scattered (and, for HSDP /
replicate, all-reduced across replicas) only on the last micro-batch with
``parallel.accum_sync = last``; with ``every`` each micro-batch reduce-scatters and
the all-reduce still runs once ([Note: accumulation modes]). Prefetching changes
when collectives run, not how many. Tensor- and context-parallel exchanges of
activations: [Note: model-parallel block memory] in fsdpkit.planner.shapes.mparallel (a
checkpointed block's recompute exchanges again). Under expert parallelism an experts
unit is gathered and reduced over shard / ep ranks, and the token dispatch adds its
all-to-alls ([Note: expert units] in fsdpkit.planner.experts.parallel).
"""

from __future__ import annotations

from fsdpkit.planner.experts.parallel import dispatch_bytes, hidden_size
from fsdpkit.planner.model.unit_layout import Unit
from fsdpkit.planner.shapes.mparallel import exchange_traffic
from fsdpkit.planner.shapes.result import CommVolume
from fsdpkit.planner.shapes.scenario import Scenario
from fsdpkit.sharding.policy import effective_reshard


def _ring(nbytes: int, group: int) -> int:
    return nbytes * (group - 1) // group if group > 1 else 0


def _gathers(sc: Scenario, u: Unit, raf: bool | int, *, first: bool, group: int) -> tuple[int, int]:
    """(bytes, calls) of all-gathers of one unit over ``group`` ranks in one micro-batch."""
    full = u.gathered * sc.param_bytes
    held_over = sc.keep_unsharded and not first  # not resharded after the last backward
    volume, calls = (0, 0) if held_over else (_ring(full, group), 1)
    if raf is True:
        volume, calls = volume + _ring(full, group), calls + 1
    elif raf is not False:
        volume, calls = volume + _ring(full, int(raf)), calls + 1
    return volume, calls if group > 1 else 0


def _group(sc: Scenario, u: Unit) -> int:
    """The ranks a unit is sharded over: shard / ep for an experts unit ([Note: expert
    units] in fsdpkit.planner.experts.parallel), else the shard group."""
    return sc.dims.efsdp if u in sc.expert_units else sc.dims.fsdp_shard


def comm_volume(sc: Scenario) -> CommVolume:
    """Per-rank collective traffic of one optimizer step of ``sc``."""
    every: list[Unit] = list(sc.all_units)
    gather = calls = 0
    for micro in range(sc.grad_accum):
        for u in every:
            group = _group(sc, u)
            raf = effective_reshard(u.reshard_after_forward, shard=group)
            v, c = _gathers(sc, u, raf, first=micro == 0, group=group)
            gather, calls = gather + v, calls + c
    rb = sc.reduce_bytes  # gradients exist for trainable parameters only (fine-tuning)
    scatters = sc.grad_accum if sc.every_sync else 1
    scatter = scatters * sum(
        _ring(u.grads_sharded * _group(sc, u) * rb, _group(sc, u)) for u in every
    )
    reduce = sum(2 * _ring(u.grads_sharded * rb, sc.dims.replicate) for u in every)
    reducing = sum(1 for u in every if u.grads_numel)
    calls += reducing * (scatters * (sc.dims.fsdp_shard > 1) + (sc.dims.replicate > 1))
    host = 0
    if sc.offload and sc.device.kind == "gpu":  # shards up per all-gather, grads down once
        up = sum(u.sharded_param_bytes for u in every) * 2 * sc.grad_accum
        host = up + sum(u.grads_sharded * 4 for u in every)
    tp_bytes = cp_bytes = 0
    if (sc.dims.tp > 1 or sc.dims.cp > 1) and sc.model is not None:
        passes = sum(2 + ckpt for u in sc.units for ckpt in u.checkpointed)
        blocks = sum(len(u.checkpointed) for u in sc.units)
        tp_bytes, cp_bytes, mp_calls = exchange_traffic(
            sc.model, tp=sc.dims.tp, cp=sc.dims.cp, sp=sc.sequence_parallel, tokens=sc.tokens,
            e=sc.param_bytes, passes=passes, vocab=sc.vocab_parallel,
            ring_backwards=blocks if sc.cp_attention == "ring" else None,
        )  # fmt: skip
        tp_bytes, cp_bytes = tp_bytes * sc.grad_accum, cp_bytes * sc.grad_accum
        calls += mp_calls * sc.grad_accum
    ep_bytes, ep_calls = _dispatch(sc)
    return CommVolume(
        all_gather=gather, reduce_scatter=scatter, all_reduce=reduce, calls=calls + ep_calls,
        host_transfer=host, tp_exchange=tp_bytes, cp_exchange=cp_bytes, ep_exchange=ep_bytes,
    )  # fmt: skip


def _dispatch(sc: Scenario) -> tuple[int, int]:
    """Expert parallelism's all-to-alls of one step (fsdpkit.planner.experts.parallel)."""
    if sc.dims.ep == 1 or sc.experts is None:
        return 0, 0
    ckpt = sum(c for u in sc.expert_units for c in u.checkpointed)
    volume, calls = dispatch_bytes(
        layers=len(sc.expert_units),
        tokens=sc.tokens // (sc.dims.cp * sc.dims.tp),  # under tp a rank routes its own
        top_k=sc.experts.top_k,
        dim=hidden_size(sc.layout) if sc.model is None else sc.model.dim, ep=sc.dims.ep,
        e=sc.param_bytes, checkpointed=ckpt,
    )  # fmt: skip
    return volume * sc.grad_accum, calls * sc.grad_accum
