"""The ``[parallel]`` section of a run's configuration: how the ranks split the model
and the batch (strategy, mesh degrees, pipeline schedule, gradient sync). Data only,
like the rest of ``fsdpkit.config.schema``, which assembles it into ``RunConfig``; the
rules between these fields live in fsdpkit.config.dims and fsdpkit.config.validate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# Strategy names must equal the keys of fsdpkit.strategies.STRATEGIES (a unit test checks).
StrategyName = Literal["full", "grad_op", "hybrid", "hybrid_grad_op", "replicate"]
AccumSync = Literal["auto", "last", "every"]
PipelineSchedule = Literal[
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]
PipelineSplit = Literal["blocks", "params"]


@dataclass(frozen=True)
class ParallelConfig:
    strategy: StrategyName = "full"
    """full (ZeRO-3), grad_op (ZeRO-2), hybrid (HSDP), hybrid_grad_op, replicate (DDP-like)."""
    shard_degree: int | None = None
    """Ranks per shard group for hybrid strategies (replicas = data-parallel ranks /
    shard_degree); empty = data-parallel ranks per node."""
    tp: int = 1
    """Tensor-parallel degree: ranks of one node that split every block's matmuls by
    heads and hidden units (the built-in Llama also splits the norms and the residual
    stream by sequence: sequence parallelism). Must divide the attention heads, the
    key/value heads and the ranks per node. The strategy's data parallelism runs over
    world / (tp x cp) ranks. See docs/parallelism.md."""
    cp: int = 1
    """Context-parallel degree: ranks that split every sequence; attention exchanges
    heads for sequence with an all-to-all (Ulysses), so each rank holds seq_len / cp
    tokens of every activation. Must divide data.seq_len and the heads (and key/value
    heads) per tensor-parallel rank. FSDP shards over the data x cp ranks."""
    ep: int = 1
    """Expert-parallel degree (mixture-of-experts models): the routed experts of every
    block are split over ep ranks borrowed from the data-parallel shard group, tokens
    sent to the ranks holding their experts and back (all-to-all); the experts are
    FSDP-sharded over the shard group's other ranks. Must divide the experts and the
    shard group. See docs/parallelism.md."""
    cp_attention: Literal["ulysses", "ring"] = "ulysses"
    """How attention is split over the cp ranks. ulysses: all-to-alls trade sequence for
    heads (any mask, packed rows included; heads per tp rank must divide by cp). ring:
    torch's ring attention, keys and values passed around the cp ranks, load-balanced
    causal chunks (data.seq_len a multiple of 2 x cp; causal rows only, so SFT needs
    data.pack = false; heads need not divide by cp). CUDA uses torch's kernels, CPU an
    fsdpkit adapter to torch's CPU kernel. See docs/parallelism.md."""
    pp: int = 1
    """Pipeline-parallel degree: the blocks split into consecutive stages over pp rank
    groups (the outermost mesh axis: only activations cross it), FSDP, tp and cp inside
    each stage; embedding on the first stage, final norm, head and loss on the last; the
    step's accumulation micro-batches run parallel.pp_schedule. See docs/parallelism.md."""
    pp_schedule: PipelineSchedule = "1F1B"
    """torch's pipelining schedule: GPipe, 1F1B (one stage per rank), Interleaved1F1B,
    LoopedBFS, InterleavedZeroBubble (looped virtual stages), ZBVZeroBubble, DualPipeV (V)."""
    pp_stages_per_rank: int | None = None
    """Stages per pipeline rank (stages = pp x this); empty = 1 for GPipe / 1F1B, else 2."""
    pp_split: PipelineSplit = "blocks"
    """blocks: as even as the blocks allow, the embedding and the head counted as one
    block each (equal stages when they divide the blocks; 126 blocks over 8 stages:
    15 + embedding, 6 x 16, 15 + head); params: contiguous stages with the fewest
    parameters on the largest (embedding first, head last)."""
    async_tp: bool = False
    """Async tensor parallelism (CUDA, with train.compile and parallel.tp > 1): inductor
    micro-pipelines each tensor-parallel all-gather / reduce-scatter with the matmul
    next to it (torch's ``_micro_pipeline_tp``, as torchtitan's async TP). Not run on a
    GPU in fsdpkit's tests yet."""
    reshard_after_forward: bool | int | None = None
    """Override the strategy's resharding: true, false, or an int to reshard to a smaller
    group (must divide the shard group size)."""
    block_classes: list[str] = field(default_factory=list)
    """Class names of the blocks to shard one per unit; empty = detect automatically."""
    blocks_per_unit: int = 1
    """Blocks grouped into one FSDP unit."""
    edge_units: bool = True
    """Shard an untied input embedding, the final norm and the output head as FSDP units
    of their own (as torchtitan) instead of in the root unit: the embedding is resharded
    after forward and the head's gradient reduce-scattered before any block's backward
    (llama3-8b, 8 ranks, full AC: a 2.7 GiB lower peak). false keeps them in the root, for
    a model that reads these weights outside their modules' forward. A tied embedding
    and head always stay in the root."""
    accum_keep_unsharded: bool = False
    """During gradient accumulation keep parameters unsharded between micro-batches
    (fewer all-gathers, but full parameters stay in memory); applies to both
    parallel.accum_sync modes."""
    accum_sync: AccumSync = "auto"
    """Gradient reduction with train.grad_accum > 1. last: only the last micro-batch
    reduce-scatters; the others accumulate unsharded gradients of every parameter in the
    reduce dtype (FSDP2's no-sync: least traffic, most memory). every: every micro-batch
    reduce-scatters into the sharded gradients (grad_accum x the reduce-scatter traffic,
    no unsharded gradients between micro-batches; HSDP all-reduces across replicas on the
    last one only). auto: last when its planned peak fits the memory budget
    (parallel.device_mem, or the device parallel.auto plans for), else every; without a
    budget, last."""
    forward_prefetch: int = 0
    """Block units whose all-gather each unit issues right after its own (explicit forward
    prefetch, FSDPModule.set_modules_to_forward_prefetch); 0 = FSDP2's implicit order.
    Each extra unit in flight holds its unsharded parameters early (memory)."""
    backward_prefetch: int = 1
    """Block units all-gathered ahead in backward; 1 = FSDP2's default (the next one),
    k > 1 = explicit prefetch of the next k (more overlap, k unsharded units in flight)."""
    timeout_s: float = 600.0
    """Collective timeout in seconds; a rank stuck longer fails the run with the step."""
    hang_timeout_s: float | None = None
    """Seconds without progress on any rank (after the first step) before the launcher
    writes a hang report (RUN_DIR/hang/report.txt) and stops the run; empty = 0.9 x
    timeout_s; 0 = only collective timeouts are triaged."""
    auto: bool = False
    """Let the planner choose strategy, mesh, resharding, activation checkpointing, offload,
    micro-batch size and parallel.accum_sync for this world size and device (as `fsdpkit
    plan --recommend`)."""
    device_mem: str | None = None
    """Device memory per rank for parallel.auto: a size (80GiB), a device name (h100) or
    NAME:SIZE; empty = detected (GPU memory, or host memory / local ranks on CPU)."""
