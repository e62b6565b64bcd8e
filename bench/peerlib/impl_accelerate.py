"""Hugging Face Accelerate with its FSDP2 plugin, as its FSDP guide writes it:
``FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
transformer_cls_names_to_wrap=[...])``, ``accelerator.prepare(model, optimizer)``,
``accelerator.backward``, ``accelerator.clip_grad_norm_``.

[Note: Accelerate on CPU]
Accelerate 1.15 does not run FSDP on CPU as shipped (bench/peerlib/probes.py shows it):
with ``cpu=True`` the state is MULTI_CPU and ``prepare`` wraps the model in DDP, the
plugin silently ignored; without ``cpu=True`` and no GPU the state is NO (each rank
trains alone as "process 0 of 1"). The FSDP branch of ``AcceleratorState`` is only
taken for GPU-like distributed types. Workaround used here (the smallest found): create
the Accelerator with ``cpu=True`` (gloo process group, CPU device), then set the shared
state's ``distributed_type = DistributedType.FSDP`` and its ``fsdp_plugin`` before
``prepare``, so ``prepare`` takes its FSDP2 path (``fsdp2_prepare_model``:
``fully_shard`` per wrapped block, then the root). The row checks the result is
really sharded (params held per rank = 1/N).
"""

from __future__ import annotations

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType

from peerlib import common


def main() -> None:
    spec = common.begin()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[common.block_class().__name__],
        reshard_after_forward=True,
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    fell_back_to = str(accelerator.distributed_type)
    accelerator.state.distributed_type = DistributedType.FSDP  # see [Note: Accelerate on CPU]
    accelerator.state.fsdp_plugin = plugin
    rank, world = accelerator.process_index, accelerator.num_processes
    batches = common.loader(spec, rank=rank, world=world)
    base = common.baseline_bytes()
    model = common.build_model(spec)
    opt = common.adamw(model, spec)
    model, opt = accelerator.prepare(model, opt)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = common.loss_of(model, tokens)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    extra = {
        "shard_fraction": common.local_shard_fraction(model),
        "adamw": common.kernel_of(opt),
        "note": f"as shipped: {fell_back_to}; forced DistributedType.FSDP",
    }
    common.run(spec, step, batches=batches, baseline=base, extra=extra)
    common.finish()


if __name__ == "__main__":
    main()
