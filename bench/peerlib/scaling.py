"""Per-rank memory vs world size for each fsdpkit strategy, measured on real gloo ranks.

For world sizes 1, 2, 4 and strategies full, grad_op, hybrid (2 replicas once there
are 2 ranks: 1x1, 2x1, 2x2) and replicate: the model state each rank holds (bytes of
its local parameter, gradient and AdamW-state tensors, counted from the real tensors
with gradients present) and the true peak of live tensor memory in one steady-state
step above what the process held before the model was built (c10's process-wide
counter; fsdpkit.planner.traced.measure). Ideal: model state / N.
"""

from __future__ import annotations

from typing import Any

import torch

STRATEGIES = ("full", "grad_op", "hybrid", "replicate")


def _overrides(strategy: str, world: int) -> list[str]:
    extra = [f"parallel.shard_degree={max(world // 2, 1)}"] if strategy == "hybrid" else []
    return [f"parallel.strategy={strategy}", "precision.mode=fp32", *extra]


def _local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def worker(rank: int, world: int, seq_len: int, micro_batch: int) -> dict[str, dict[str, int]]:
    """run_ranks body: {strategy: {"model_state": bytes, "peak": bytes}} of this rank."""
    from fsdpkit import config as configuration
    from fsdpkit.config import ParallelDims, mesh_shape
    from fsdpkit.cpumem import enable_process_wide_accounting, live_bytes, peak_bytes
    from fsdpkit.loss.contract import next_token_loss
    from fsdpkit.models.llama import Llama, preset
    from fsdpkit.sharding import shard
    from fsdpkit.sharding.mesh import build_mesh
    from fsdpkit.trainable.optim import build_optimizer
    from fsdpkit.trainable.step import train_step

    enable_process_wide_accounting()
    out = {}
    gen = torch.Generator().manual_seed(rank)
    batch = [torch.randint(0, 256, (micro_batch, seq_len + 1), generator=gen)]
    for strategy in STRATEGIES:
        base = live_bytes()  # what earlier strategies left behind is not this one's
        cfg = configuration.load(None, _overrides(strategy, world))
        replicate, shard_deg = mesh_shape(cfg, world_size=world, local_world_size=world)
        mesh = build_mesh(ParallelDims(replicate=replicate, shard=shard_deg), device_type="cpu")
        with torch.device("meta"):
            model = Llama(preset("tiny", max_seq_len=max(seq_len, 256)))
        shard(model, cfg, mesh=mesh)
        opt = build_optimizer(model, cfg.train)
        step = {"loss_fn": next_token_loss, "max_norm": cfg.train.grad_clip}
        train_step(model, opt, batch, **step)  # creates the AdamW states
        peak = peak_bytes(lambda m=model, o=opt, k=step: train_step(m, o, batch, **k)) - base
        next_token_loss(model, batch[0]).backward()  # gradients as the optimizer sees them
        params = list(model.parameters())
        grads = [p.grad for p in params]
        states = [v for s in opt.state.values() for v in s.values()]
        state = _local_bytes(params) + _local_bytes(grads) + _local_bytes(states)
        out[strategy] = {"model_state": state, "peak": peak}
        del model, opt
    return out


def measure(*, worlds: tuple[int, ...], seq_len: int, micro_batch: int) -> dict[int, Any]:
    """{world: [per-rank worker results]} (one spawn per world size)."""
    from fsdpkit.testing import run_ranks

    return {
        w: run_ranks(worker, world_size=w, args=(seq_len, micro_batch), timeout_s=600)
        for w in worlds
    }


def plot(results: dict[int, Any], path: Any) -> None:
    """Two panels (model state, step peak) of rank 0's MiB vs world size, with 1/N."""
    from matplotlib.figure import Figure

    worlds = sorted(results)
    fig = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    for ax, key, title in zip(
        fig.subplots(1, 2), ("model_state", "peak"), ("model state per rank", "step peak per rank")
    ):
        for strategy, marker, width in zip(STRATEGIES, "osD^", (4, 1.5, 1.5, 1.5)):
            mib = [results[w][0][strategy][key] / 2**20 for w in worlds]
            ax.plot(worlds, mib, marker=marker, linewidth=width, label=strategy)
        one = results[worlds[0]][0]["full"][key] / 2**20
        ax.plot(worlds, [one / w for w in worlds], "k--", label="ideal 1/N")
        ax.set_title(f"{title} (tiny Llama, fp32)")
        ax.set_xlabel("world size (gloo ranks)")
        ax.set_ylabel("MiB")
        ax.set_xticks(worlds)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path)
