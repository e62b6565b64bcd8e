"""fsdpkit's library API as its README shows it: meta-device model, ``fsdpkit.shard``
(every block its own unit, full sharding), AdamW after sharding, ``fsdpkit.clip_grad_norm``.

At the shared settings: the shared AdamW (``common.adamw``) and full-logits loss
(``common.loss_of``) as every other row; the units are the hand-written loop's (the
tiny preset ties its embedding and head, so ``parallel.edge_units`` adds none)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import fsdpkit
from fsdpkit.models.llama import Llama, preset
from peerlib import common


def main() -> None:
    spec = common.begin()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = common.loader(spec, rank=rank, world=world)
    base = common.baseline_bytes()
    cfg = fsdpkit.config.load(None, [f"train.seed={spec.seed}", "precision.mode=fp32"])
    mesh = fsdpkit.build_mesh(device_type="cpu")
    with torch.device("meta"):
        model = Llama(preset(spec.preset, max_seq_len=max(spec.seq_len, 256)))
    fsdpkit.shard(model, cfg, mesh=mesh)
    opt = common.adamw(model, spec)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = common.loss_of(model, tokens)
        loss.backward()
        fsdpkit.clip_grad_norm(model, spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    extra = {"shard_fraction": common.local_shard_fraction(model), "adamw": common.kernel_of(opt)}
    common.run(spec, step, batches=batches, baseline=base, extra=extra)
    common.finish()


if __name__ == "__main__":
    main()
