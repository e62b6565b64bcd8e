"""What a plan says: per-rank memory at its peak, where the peak is, traffic, verdict.

Plain frozen dataclasses (``asdict``-able for ``--json``); the planner fills them,
``fsdpkit.planner.formatting`` formats them. Sizes are bytes per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdpkit.planner.shapes.scenario import Scenario

CATEGORIES: dict[str, str] = {
    "sharded_params": "sharded parameters (fp32 master)",
    "gradients": "gradients (sharded, fp32)",
    "optimizer_states": "optimizer states (AdamW m, v)",
    "unsharded_params": "unsharded parameters in flight",
    "collective_buffers": "all-gather / reduce-scatter buffers",
    "exchange_buffers": "tp / cp activation exchange buffers",
    "unsharded_grads": "unsharded gradients (before reduce-scatter)",
    "activations": "activations kept for backward",
    "logits_loss": "logits and loss buffers",
    "temporaries": "temporaries (activation grads, op workspaces)",
    "buffers_inputs": "buffers and inputs",
    "reference": "DPO reference model (frozen, forward only)",
}
"""Breakdown keys, in report order, with their human labels."""

ROLLOUT_CATEGORIES: dict[str, str] = {
    "kv_cache": "rollout KV cache (one decode batch)",
    "rollout_logits": "rollout logits and token draw",
    "vllm_engine": "vLLM engine weights and KV cache",
}
"""The breakdown keys only a GRPO rollout's peak has ([Note: rollout memory] in
fsdpkit.planner.replay.rolloutmem), reported after CATEGORIES; there the gathered model
is "unsharded_params"."""

PHASES = ("forward", "backward", "optimizer step")
ROLLOUT = "rollout"
"""A GRPO step's phase before the training step's three ([Note: the GRPO step in the
plan] in fsdpkit.planner.model.grpo_terms)."""
ALL_CATEGORIES = CATEGORIES | ROLLOUT_CATEGORIES
ALL_PHASES = (ROLLOUT, *PHASES)
"""What a report lists, in order (a key or phase a plan lacks is left out)."""


@dataclass(frozen=True)
class PeakPoint:
    """The largest live tensor memory of the step and what made it up."""

    bytes: int
    phase: str
    """One of PHASES."""
    where: str
    """Where in that phase, e.g. "backward of layers.31" or "log-softmax backward"."""
    breakdown: dict[str, int]
    """Live bytes per CATEGORIES key at that moment."""


@dataclass(frozen=True)
class CommVolume:
    """Bytes each rank sends (= receives, ring algorithms) per optimizer step."""

    all_gather: int
    reduce_scatter: int
    all_reduce: int
    """HSDP / replicate gradient all-reduce across replicas."""
    calls: int
    """Collective calls per step."""
    host_transfer: int = 0
    """Host<->device copies per step with CPU offload (not network traffic)."""
    tp_exchange: int = 0
    """Tensor-parallel activation all-gathers / reduce-scatters (or all-reduces)."""
    cp_exchange: int = 0
    """Context-parallel all-to-alls of q, k, v and attention's output."""
    ep_exchange: int = 0
    """Expert parallelism's token dispatch (all-to-alls), balanced routing."""

    @property
    def total(self) -> int:
        return (
            self.all_gather + self.reduce_scatter + self.all_reduce
            + self.tp_exchange + self.cp_exchange + self.ep_exchange
        )  # fmt: skip


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank memory of one steady-state training step (optimizer states exist,
    gradients were set to None by the previous zero_grad)."""

    mode: str
    """"analytic" or "traced"."""
    peak: PeakPoint
    phase_peaks: dict[str, int]
    """Highest live bytes reached in each phase."""
    model_states: dict[str, int]
    """Sharded params, gradients and optimizer states held by this rank at the optimizer
    step (on the host with CPU offload on a GPU)."""
    host_bytes: int
    """Host memory for CPU offload (0 without offload, or when the device is the CPU)."""
    notes: tuple[str, ...] = ()
    spread: int = 0
    """How much higher than ``peak`` some steps may go: see [Note: late frees]."""
    staging_bytes: int = 0
    """Host memory async checkpointing keeps for its staging buffers for the life of
    the run (checkpoint.async_save; fsdpkit.checkpoint.async_staging_bytes)."""


@dataclass(frozen=True)
class LossBuffers:
    """The most logits and loss bytes live at once in one micro-batch, for the chosen
    loss and for the other one (``train.chunked_loss``)."""

    chunk: int | None
    """Tokens per chunk of the chunked loss; None: full logits."""
    chosen: int
    full: int
    """With full logits (equal to ``chosen`` when they are chosen)."""


@dataclass(frozen=True)
class Plan:
    """A full plan: the scenario, its memory, its traffic and whether it fits."""

    scenario: Scenario
    memory: MemoryPlan
    comm: CommVolume
    device_bytes: int | None
    """Device memory (None: unknown)."""
    usable_bytes: int | None
    """Device memory minus the runtime reserve and the safety margin."""
    margin: float
    fits: bool | None
    """peak <= usable; None when the device memory is unknown."""
    elapsed_s: float = 0.0
    other: MemoryPlan | None = field(default=None)
    """The analytic plan alongside a traced one (for comparison), else None."""
    loss: LossBuffers | None = None
    """Logits and loss buffers of the chosen loss mode (analytic)."""
    data_host_bytes: int = 0
    """Host memory one rank's data path holds while training (fsdpkit.data.host_bytes:
    mapped shards hold nothing per token; SFT rows a few bytes each); 0 without a
    config."""
    pipeline: Any = None
    """Under parallel.pp: every pipeline rank's memory and traffic and the schedule's
    bubble (fsdpkit.planner.pipeline.plan.PipelinePlan); ``memory`` and ``comm`` are then
    the rank with the highest peak's. None without pp."""
    grpo: Any = None
    """Under train.objective = grpo: the rollout phase and the training phase's own peak
    (fsdpkit.planner.replay.rolloutmem.GrpoPhases); ``memory.peak`` is the larger.
    None otherwise."""

    @property
    def headroom(self) -> int | None:
        return None if self.usable_bytes is None else self.usable_bytes - self.memory.peak.bytes
