"""A minimal hand-written FSDP2 training loop: the baseline ``train_throughput.py``
compares ``fsdpkit train`` against. Same model code, data and hyper-parameters as
``fsdpkit train``'s defaults, written the way torch's FSDP2 docs write a loop:

    torchrun --standalone --nproc-per-node 2 bench/handwritten_loop.py \
        STEPS SEQ BATCH OUT.json [ADAMW]

ADAMW is the torch AdamW kernel: fused (default: what ``fsdpkit train`` steps on CPU),
foreach, for-loop, or default (no switch: torch's own choice, for-loop on CPU). Weight
decay on matrices only and the LR schedule (linear warm-up over 20 steps, then cosine
to 0.1x) are fsdpkit's, so the two loops train the same numbers; the loss is full fp32
logits with ``F.cross_entropy`` (``fsdpkit train train.chunked_loss=off``). Rank 0
writes every step's time and global mean loss to OUT.json.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdpkit import init_weights
from fsdpkit.config import DataConfig
from fsdpkit.data import PackedLoader, build_tokenizer, load_token_stream, split_tokens
from fsdpkit.models.llama import Llama, preset

KERNELS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
WARMUP, FLOOR = 20, 0.1


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up, then cosine to FLOOR over the remaining steps (fsdpkit's default)."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    progress = min((step - WARMUP) / max(steps - WARMUP, 1), 1.0)
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))


def main() -> None:
    steps, seq, batch, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    kernel = sys.argv[5] if len(sys.argv) > 5 else "fused"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    data = DataConfig(seq_len=seq)
    tokens, _ = split_tokens(load_token_stream(data, build_tokenizer(data)), val_fraction=0.02)
    loader = PackedLoader(
        tokens, seq_len=seq, micro_batch_size=batch, dp_rank=rank, dp_world=world, seed=0
    )
    model = Llama(preset("tiny", max_seq_len=max(seq, 256)))
    init_weights(model, seed=0)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), **KERNELS.get(kernel, {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        x = loader.next_batch()
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(float(mean))
        float(norm)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_times": times, "losses": losses, "kernel": kernel}, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
