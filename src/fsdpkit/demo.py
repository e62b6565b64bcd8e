"""Library demo: shard the tiny Llama over 2 CPU ranks and train a few steps.

    python -m fsdpkit.demo [--steps 20] [--nproc 2]

Shows the library API a hand-written loop uses: build_mesh -> shard -> optimizer
(after sharding) -> gradient_sync / clip_grad_norm. ``fsdpkit train`` is the full job.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdpkit import RunConfig, build_mesh, clip_grad_norm, shard
from fsdpkit.models.llama import Llama, preset
from fsdpkit.testing import run_ranks


def _train(rank: int, world: int, steps: int) -> list[float]:
    cfg = RunConfig()
    with torch.device("meta"):
        model = Llama(preset("tiny", n_layers=2, max_seq_len=64))
    plan = shard(model, cfg, mesh=build_mesh(device_type="cpu"))
    if rank == 0:
        print(f"plan: {plan.describe()}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(steps):
        # A learnable toy task: each sequence counts up modulo 256 from a random start.
        start = torch.randint(0, 256, (4, 1), generator=gen)
        tokens = (start + torch.arange(65)) % 256
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        loss.backward()
        norm = clip_grad_norm(model, 1.0)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  grad-norm {norm:.3f}", flush=True)
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    run_ranks(_train, world_size=args.nproc, args=(args.steps,), timeout_s=600)


if __name__ == "__main__":
    main()
