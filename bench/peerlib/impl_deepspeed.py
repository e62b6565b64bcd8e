"""DeepSpeed ZeRO-3, as its getting-started guide writes it: ``deepspeed.initialize``
with a config dict (ZeRO stage 3, AdamW, gradient clipping), ``engine.backward``,
``engine.step``. On CPU DeepSpeed picks its CPU accelerator and gloo by itself (its
first run JIT-compiles a small shared-memory communication op with ninja).

Differences a reader should know: ZeRO-3 partitions each parameter on its own and
gathers by prefetch buckets, not by transformer block; clipping is done inside
``engine.step``. The AdamW: at the shared settings ``torch_adam: true`` with the
shared kernel's switch (``fused: true``) among the optimizer params, which DeepSpeed
passes on to torch.optim.AdamW, the one every other row steps; at DeepSpeed's defaults
(``Spec.adamw = "default"``) no ``torch_adam``, so DeepSpeed picks its own (its
``FusedAdam`` op, JIT-built for the CPU accelerator).
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
                **({} if spec.adamw == "default" else {"torch_adam": True}),
                **common.adamw_kwargs(spec),
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
        "adamw": common.kernel_of(engine.optimizer.optimizer),
    }
    common.run(spec, step, batches=batches, baseline=base, extra=extra)
    common.finish()


if __name__ == "__main__":
    main()
