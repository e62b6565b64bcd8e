"""A minimal hand-written FSDP2 loop (torch's own docs): fully_shard every block, then
the root; AdamW after sharding; clip_grad_norm_ over the DTensor parameters."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from peerlib import common


def main() -> None:
    spec = common.begin()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = common.loader(spec, rank=rank, world=world)
    base = common.baseline_bytes()
    mesh = init_device_mesh("cpu", (world,))
    model = common.build_model(spec)
    for block in model.modules():
        if isinstance(block, common.block_class()):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = common.adamw(model, spec)

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
