"""Lightning Fabric's FSDP2 path, as its docs write it: ``ModelParallelStrategy`` with a
``parallelize_fn`` that calls ``fully_shard`` per block and on the root,
``fabric.setup(model)``, an optimizer built after setup, ``fabric.backward`` and
``fabric.clip_gradients``.

On CPU (Lightning 2.6): ``FSDPStrategy`` refuses CPU; ``ModelParallelStrategy`` runs, but
its default mesh sizes ("auto") put every rank on the tensor-parallel axis and the
data-parallel axis has size 1, so ``fully_shard`` on it silently does not shard. So
``data_parallel_size=world, tensor_parallel_size=1`` is passed explicitly (checked:
params held per rank = 1/N).
"""

from __future__ import annotations

import os

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from peerlib import common


def parallelize(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    mesh = device_mesh["data_parallel"]
    for block in model.modules():
        if isinstance(block, common.block_class()):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    spec = common.begin()
    world = int(os.environ["WORLD_SIZE"])
    strategy = ModelParallelStrategy(
        parallelize_fn=parallelize, data_parallel_size=world, tensor_parallel_size=1
    )
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="32-true")
    fabric.launch()
    batches = common.loader(spec, rank=fabric.global_rank, world=fabric.world_size)
    base = common.baseline_bytes()
    model = fabric.setup(common.build_model(spec))
    opt = fabric.setup_optimizers(common.adamw(model, spec))

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = common.loss_of(model, tokens)
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    extra = {"shard_fraction": common.local_shard_fraction(model), "adamw": common.kernel_of(opt)}
    common.run(spec, step, batches=batches, baseline=base, extra=extra)
    common.finish()


if __name__ == "__main__":
    main()
