"""The true per-rank peak of tensor memory of training steps, on CPU ranks.

Counted with fsdpkit.cpumem ([Note: measuring CPU peaks]): the process-wide live total
at every allocation, so the peak includes buffers inside gloo collectives. Used by
bench/plan_accuracy.py and the accuracy tests to check the planner.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdpkit.config import RunConfig, parallel_dims
from fsdpkit.cpumem import enable_process_wide_accounting, live_bytes, peak_bytes
from fsdpkit.models.accessors import input_vocab
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.sharding.mesh import build_mesh
from fsdpkit.trainable.build import build_unsharded, shard_trainable
from fsdpkit.trainable.pipeline.step import pipeline_step
from fsdpkit.trainable.step import step_options, synthetic_batches, train_step


def measure_step_peaks(
    rank: int,
    world_size: int,
    specs: list[tuple[str, RunConfig, LlamaConfig | None]],
    steps: int = 1,
) -> dict[str, list[int]]:
    """run_ranks worker: for each (name, RunConfig, model shape), the true peak of
    ``steps`` steady-state steps (one number per step) minus what the process held
    before building the model. Shape None: the run's model.hf / model.factory model,
    built by the trainer's builder."""
    records = measure_step_records(rank, world_size, specs, steps)
    return {name: [r["peak"] for r in steps_] for name, steps_ in records.items()}


def pipeline_rank_peaks(
    per_rank: list[dict[str, list[int]]], name: str, *, cfg: RunConfig
) -> dict[int, list[int]]:
    """``measure_step_peaks``' results (one dict per global rank) of the pipelined run
    ``name`` -> per pipeline rank, each step's peak over the ranks that hold its
    stages (what that pipeline rank's plan is checked against)."""
    world = len(per_rank)
    dims = parallel_dims(cfg, world_size=world, local_world_size=world)
    steps = len(per_rank[0][name])
    out: dict[int, list[int]] = {}
    for pp_rank in range(dims.pp):
        ranks = [g for g in range(world) if dims.pp_rank(g) == pp_rank]
        out[pp_rank] = [max(per_rank[g][name][i] for g in ranks) for i in range(steps)]
    return out


def measure_step_records(
    rank: int,
    world_size: int,
    specs: list[tuple[str, RunConfig, LlamaConfig | None]],
    steps: int = 1,
) -> dict[str, list[dict[str, Any]]]:
    """run_ranks worker: as ``measure_step_peaks``, each step's ``peak`` with the
    routing a MoE model under ep recorded in it (``moe_imbalance`` and
    ``moe_imbalance_layer_max``: the busiest rank's, [Note: routing imbalance] in
    fsdpkit.sharding.experts.dispatch; the step's metrics are a collective, read outside the
    measured peak) and this rank's own load of each MoE layer (``moe_layer_loads``)."""
    enable_process_wide_accounting()
    return {
        name: _step_peaks(cfg, shape, rank=rank, world_size=world_size, steps=steps)
        for name, cfg, shape in specs
    }


def _step_peaks(
    cfg: RunConfig, shape: LlamaConfig | None, *, rank: int, world_size: int, steps: int
) -> list[dict[str, Any]]:
    base = live_bytes()
    # the trainer's own mesh: (replicate, shard, cp, tp, ep) of [Note: parallel dimensions]
    dims = parallel_dims(cfg, world_size=world_size, local_world_size=world_size)
    mesh = build_mesh(dims, device_type="cpu")
    vocab = shape.vocab_size if shape is not None else 1  # model.hf / factory: its own
    unsharded = build_unsharded(cfg, vocab_size=vocab, device_type="cpu", shape=shape)
    run = shard_trainable(unsharded, cfg, mesh=mesh, device=torch.device("cpu"))
    # ranks of one tp / cp group read the same batches (they split its work, not its data)
    gen = torch.Generator().manual_seed(dims.dp_rank(rank))
    vocab = input_vocab(run.model, default=256) if shape is None else vocab
    batches = synthetic_batches(cfg, dp_world=dims.dp, vocab_size=vocab, generator=gen)

    def step() -> None:
        if run.pipeline is not None:  # [Note: the pipelined step]
            clip = cfg.train.grad_clip
            pipeline_step(run.pipeline, run.model, run.optimizer, batches, max_norm=clip)
            return
        train_step(run.model, run.optimizer, batches, loss_fn=run.loss_fn, **step_options(cfg))

    metrics = getattr(run.loss_fn, "step_metrics", None) if dims.ep > 1 else None
    found = (getattr(m, "expert_dispatch", None) for m in run.model.modules())
    dispatches = [d for d in found if d is not None and d.group is not None]

    def routing() -> dict[str, Any]:
        """The step's routing: the maxima over the ranks, and this rank's own loads
        (each MoE layer's mean over the step's dispatches, its largest, each one). The
        step's metrics reset the dispatches' counts; where there are none (a pipelined
        run's stages), reading them does."""
        calls = [c for d in dispatches if (c := d.calls())]
        loads = [x for d in dispatches if (x := d.loads(reset=metrics is None)) is not None]
        found = metrics() if metrics is not None else {}
        out = {k: v for k, v in found.items() if k.startswith("moe_imbalance")}
        if not loads:
            return out
        return out | {
            "moe_layer_loads": [x[0] for x in loads],
            "moe_layer_peaks": [x[1] for x in loads],
            "moe_layer_calls": calls,
        }

    step()  # creates the AdamW states
    routing()
    return [{"peak": peak_bytes(step) - base, **routing()} for _ in range(steps)]
