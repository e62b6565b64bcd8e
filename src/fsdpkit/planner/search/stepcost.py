"""Estimated step time of a scenario: a relative cost the recommender ranks by, not a
prediction (the model is described in fsdpkit.planner.search.recommend's docstring).

    step = max(compute + recompute, communication) + offload transfers + exchanges

The exchanges (tp / cp activations, expert parallelism's token dispatch) wait on the
layers that produce their inputs, so they add to the step rather than overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpkit.planner.pipeline.degrees import pipeline_cost
from fsdpkit.planner.replay.blockmem import block_matmuls
from fsdpkit.planner.replay.comm import comm_volume
from fsdpkit.planner.shapes.scenario import Scenario
from fsdpkit.planner.shapes.states import model_states
from fsdpkit.sharding.activations import matmul_saved

MFU = 0.40
"""Assumed model FLOPs utilization, for ranking only."""
LATENCY_S = 50e-6
HOST_MEMORY_GBPS = 20.0
SMALL_BATCH_TOKENS = 256
"""Tokens per micro-batch at which matmul efficiency is taken to halve (ranking only)."""


@dataclass(frozen=True)
class StepCost:
    """Estimated seconds per optimizer step, by cause (for ranking and explaining)."""

    compute_s: float
    recompute_s: float
    comm_s: float
    """Collective time; overlapped with compute."""
    offload_s: float
    exchange_s: float = 0.0
    """Tensor- / context-parallel activation exchanges and expert parallelism's token
    dispatch: on the critical path, not overlapped ([Note: model-parallel block
    memory], [Note: expert units])."""

    @property
    def total_s(self) -> float:
        return (
            max(self.compute_s + self.recompute_s, self.comm_s) + self.offload_s
            + self.exchange_s
        )  # fmt: skip


def step_cost(sc: Scenario) -> StepCost:
    """Estimated step time of a scenario (see the module docstring); needs no memory
    plan, so a traced search can rank before it traces."""
    dev = sc.device
    compute = sc.tokens * sc.grad_accum * sc.flops_per_token / (sc.dims.tp * sc.dims.cp)
    compute *= (1 + SMALL_BATCH_TOKENS / sc.tokens) / (dev.tflops * 1e12 * MFU)
    matmul = sc.model.matmul_params() if sc.model is not None else sc.num_params
    blocks = sum(r * c for b in sc.layout.blocks for r, c in b) / max(matmul, 1)
    share = sc.checkpointed_blocks / max(len(sc.layout.blocks), 1)
    recompute = compute * share * blocks / 3 * recompute_fraction(sc)
    m = sc.model
    if sc.loss_chunk is not None and m is not None:  # the head's matmul again in backward
        recompute += compute * m.vocab_size * m.dim / max(m.matmul_params(), 1) / 3
    if m is not None and sc.dims.tp > 1:  # the head is not split over tp: every tp rank runs it
        recompute += compute * m.vocab_size * m.dim / max(m.matmul_params(), 1) * (sc.dims.tp - 1)
    compute_share, traffic_share, p2p = pipeline_cost(sc)  # [Note: pipeline in the recommender]
    compute, recompute = compute * compute_share, recompute * compute_share
    shard_link = (
        dev.intra_gbps if sc.dims.fsdp_shard * sc.dims.tp <= sc.ranks_per_node else dev.inter_gbps
    )
    stage = sc.dims.world // sc.dims.pp
    replica_link = dev.intra_gbps if stage <= sc.ranks_per_node else dev.inter_gbps
    c = comm_volume(sc)
    comm = (c.all_gather + c.reduce_scatter) / (shard_link * 1e9) * traffic_share
    comm += c.all_reduce / (replica_link * 1e9) * traffic_share + c.calls * LATENCY_S
    offload = 0.0
    if sc.offload and dev.kind == "gpu":
        local = sum(model_states(sc).values())
        offload = c.host_transfer / (dev.host_gbps * 1e9) + local / (HOST_MEMORY_GBPS * 1e9)
    cp_link = dev.intra_gbps if sc.dims.tp * sc.dims.cp <= sc.ranks_per_node else dev.inter_gbps
    exchange = c.tp_exchange / (dev.intra_gbps * 1e9) + c.cp_exchange / (cp_link * 1e9)
    ep_link = dev.intra_gbps if sc.dims.ep * sc.dims.tp <= sc.ranks_per_node else dev.inter_gbps
    exchange += c.ep_exchange / (ep_link * 1e9)  # ep: the fastest data axis, contiguous
    exchange = exchange * traffic_share + p2p / (dev.inter_gbps * 1e9)
    return StepCost(compute, recompute, comm, offload, exchange)


def recompute_fraction(sc: Scenario) -> float:
    """Share of a checkpointed block's forward FLOPs that backward runs again: all
    under full checkpointing; under selective the matmuls the policy recomputes
    (fsdpkit.sharding.activations.matmul_saved), over the block's matmuls plus
    attention (saved, never recomputed). Elementwise ops are not counted."""
    if sc.ac_mode != "selective":
        return 1.0
    m = sc.model
    if m is None:  # a block the analytic model does not know: every other matmul
        return 0.5
    mms = block_matmuls(
        d=m.dim, f=m.ffn_dim, heads=m.n_heads, kv_heads=m.n_kv_heads, head_dim=m.head_dim
    )
    redone = sum(p for i, p in enumerate(mms) if not matmul_saved(i + 1))
    return redone / (sum(mms) + 2 * m.n_heads * m.head_dim * sc.seq_len)
