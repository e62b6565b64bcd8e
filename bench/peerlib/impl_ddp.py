"""DDP, the unsharded reference: every rank holds the whole model and optimizer state;
gradients are all-reduced. Its losses are the reference every other row must match."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from peerlib import common


def main() -> None:
    spec = common.begin()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = common.loader(spec, rank=rank, world=world)
    base = common.baseline_bytes()
    model = DistributedDataParallel(common.build_model(spec))
    opt = common.adamw(model.module, spec)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = common.loss_of(model, tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    extra = {"shard_fraction": common.local_shard_fraction(model), "adamw": common.kernel_of(opt)}
    common.run(spec, step, batches=batches, baseline=base, extra=extra)
    common.finish()


if __name__ == "__main__":
    main()
