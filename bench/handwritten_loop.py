"""A minimal hand-written FSDP2 training loop: the baseline ``train_throughput.py``
compares ``fsdpkit train`` against. Same model code, same data, same settings.

    torchrun --standalone --nproc-per-node 2 bench/handwritten_loop.py STEPS SEQ BATCH OUT.json
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

from fsdpkit.config import DataConfig
from fsdpkit.data import PackedLoader, build_tokenizer, load_token_stream, split_tokens
from fsdpkit.init import init_weights
from fsdpkit.models.llama import Llama, preset


def main() -> None:
    steps, seq, batch, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
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
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warm = 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(
            (s + 1) / warm,
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(max(s - warm, 0) / steps, 1))),
        ),
    )
    times = []
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
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        float(loss), float(norm)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        steady = times[2:]
        tps = batch * seq * world * len(steady) / sum(steady)
        with open(out, "w") as f:
            json.dump({"tokens_per_s": tps}, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
