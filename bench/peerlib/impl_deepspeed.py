"""DeepSpeed ZeRO-3, as its getting-started guide writes it: ``deepspeed.initialize``
with a config dict (ZeRO stage 3, AdamW, gradient clipping), ``engine.backward``,
``engine.step``. On CPU DeepSpeed picks its CPU accelerator and gloo by itself (its
first run JIT-compiles a small shared-memory communication op with ninja).

Differences a reader should know: ZeRO-3 partitions each parameter on its own and
gathers by prefetch buckets, not by transformer block; its AdamW is DeepSpeed's
choice for the device (``torch_adam: true`` asks for torch.optim.AdamW, the one every
other row uses); clipping is done inside ``engine.step``.
"""

from __future__ import annotations

import logging

import deepspeed
import torch
import torch.distributed as dist

from peerlib import common


def main() -> None:
    spec = common.begin()
    deepspeed.init_distributed(dist_backend="gloo")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = common.loader(spec, rank=rank, world=world)
    base = common.baseline_bytes()
    model = common.build_model(spec)
    config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": spec.grad_clip,
        "zero_optimization": {"stage": 3},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": spec.lr,
                "betas": [spec.beta1, spec.beta2],
                "eps": 1e-8,
                "weight_decay": spec.weight_decay,
                "torch_adam": True,
            },
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    groups = common.param_groups(model, spec)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = common.loss_of(engine, tokens)
        engine.backward(loss)
        engine.step()  # clips, steps AdamW, zeroes the gradients
        return loss

    extra = {
        "shard_fraction": common.local_shard_fraction(engine.module),
        "note": f"optimizer {type(engine.optimizer.optimizer).__name__} under ZeRO stage 3",
    }
    common.run(spec, step, batches=batches, baseline=base, extra=extra)
    common.finish()


if __name__ == "__main__":
    main()
