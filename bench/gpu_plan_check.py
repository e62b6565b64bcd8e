"""Planner vs torch.cuda.max_memory_allocated on one GPU (run on a GPU machine).

    python bench/gpu_plan_check.py              # llama3-1b and llama3-3b, a few settings
    python bench/gpu_plan_check.py --quick      # llama3-1b only

World size 1: ``fsdpkit.shard`` on a 1-rank mesh (FSDP2 still keeps fp32 sharded
params and casts an unsharded bf16 copy, so every term of the plan is exercised but
the communication). Each row trains two steps with the trainer's step and optimizer
(fsdpkit.trainable.step, fsdpkit.trainable.optim), resets the CUDA peak before the second
one and compares the steady-state peak of allocated tensor memory with the analytic
plan (the traced plan models the device as the CPU, so it is printed for reference).
Exit 1 when an analytic prediction is off by more than 10%. Never run in CI.
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdpkit.config import RunConfig, load
from fsdpkit.loss.contract import next_token_loss
from fsdpkit.loss.head import choose_loss
from fsdpkit.models.llama import Llama
from fsdpkit.planner import Device, plan
from fsdpkit.planner.scenario import model_shape
from fsdpkit.sharding import shard
from fsdpkit.sharding.mesh import build_mesh
from fsdpkit.trainable.optim import build_optimizer
from fsdpkit.trainable.step import train_step

GiB = 1024**3


@dataclass(frozen=True)
class Row:
    name: str
    overrides: tuple[str, ...]

    def config(self) -> RunConfig:
        return load(None, ["precision.mode=bf16", *self.overrides])


ROWS = [
    Row("1b AC full 1x2048", ("model.preset=llama3-1b", "data.seq_len=2048",
                              "train.micro_batch_size=1", "activations.mode=full")),
    Row("1b no AC 1x1024", ("model.preset=llama3-1b", "data.seq_len=1024",
                            "train.micro_batch_size=1")),
    Row("1b AC every 2 2x2048", ("model.preset=llama3-1b", "data.seq_len=2048",
                                 "train.micro_batch_size=2", "activations.mode=every")),
    Row("1b AC full accum 2", ("model.preset=llama3-1b", "data.seq_len=2048",
                               "train.micro_batch_size=1", "train.grad_accum=2",
                               "activations.mode=full")),
    Row("3b AC full 1x2048", ("model.preset=llama3-3b", "data.seq_len=2048",
                              "train.micro_batch_size=1", "activations.mode=full")),
    # issue 12: the rows above run the chunked loss (auto); these with full logits
    Row("1b 1x1024 full logits", ("model.preset=llama3-1b", "data.seq_len=1024",
                                        "train.micro_batch_size=1", "train.chunked_loss=off")),
    Row("1b AC full chunk 256", ("model.preset=llama3-1b", "data.seq_len=2048",
                                        "train.micro_batch_size=1", "activations.mode=full",
                                        "train.loss_chunk_tokens=256")),
]  # fmt: skip


def measure(cfg: RunConfig) -> int:
    """Steady-state peak of allocated CUDA memory of one step, minus the baseline."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    mesh = build_mesh(shard=1, device_type="cuda", world_size=1)
    shape = model_shape(cfg)
    with torch.device("meta"):
        model = Llama(shape)
    shard(model, cfg, mesh=mesh)
    opt = build_optimizer(model, cfg.train)
    size = (cfg.train.micro_batch_size, cfg.data.seq_len + 1)
    batches = [
        torch.randint(0, shape.vocab_size, size, device="cuda") for _ in range(cfg.train.grad_accum)
    ]
    loss_fn = choose_loss(
        model,
        mode=cfg.train.chunked_loss,
        chunk_tokens=cfg.train.loss_chunk_tokens,
        default=next_token_loss,
        custom_loss=False,
    ).loss_fn  # the run's loss, as the planner plans it (train.chunked_loss)
    kw = {"loss_fn": loss_fn, "max_norm": cfg.train.grad_clip}
    train_step(model, opt, batches, **kw)  # creates the AdamW states
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step(model, opt, batches, **kw)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del model, opt, batches
    return peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="llama3-1b rows only")
    parser.add_argument("--trace", action="store_true", help="also run the traced planner")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_plan_check: no CUDA device; run this on a GPU machine.", file=sys.stderr)
        return 2
    total = torch.cuda.get_device_properties(0).total_memory
    device = Device(torch.cuda.get_device_name(0), "gpu", total, runtime_reserve=GiB)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("LOCAL_RANK", "0")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            worst = run_rows([r for r in ROWS if not args.quick or r.name.startswith("1b")],
                             device=device, trace=args.trace)  # fmt: skip
        finally:
            dist.destroy_process_group()
    print(f"\nworst analytic error {worst:.1%} (target 10%) on {device.name}")
    return 0 if worst <= 0.10 else 1


def run_rows(rows: list[Row], *, device: Device, trace: bool) -> float:
    print(
        f"{'configuration':<24}{'measured':>11}{'analytic':>11}{'err':>8}{'traced*':>11}  peak at"
    )
    worst = 0.0
    for row in rows:
        cfg = row.config()
        predicted = plan(cfg, world_size=1, device=device)
        true = measure(cfg)
        err = (predicted.memory.peak.bytes - true) / true
        worst = max(worst, abs(err))
        traced = "-"
        if trace:
            traced = f"{_traced(cfg, device) / GiB:>10.2f}G"
        peak = predicted.memory.peak
        print(
            f"{row.name:<24}{true / GiB:>10.2f}G{peak.bytes / GiB:>10.2f}G{err:>+8.1%}"
            f"{traced:>11}  {peak.phase}: {peak.where}"
        )
    return worst


def _traced(cfg: RunConfig, device: Device) -> int:
    """The traced plan needs a process without a process group: run it in a child."""
    code = (
        "import sys, pickle; from fsdpkit.planner import plan; "
        "cfg, dev = pickle.loads(sys.stdin.buffer.read()); "
        "print(plan(cfg, world_size=1, device=dev, trace=True).memory.peak.bytes)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps((cfg, device)), capture_output=True,
        check=True,
    )  # fmt: skip
    return int(out.stdout.decode().split()[-1])


if __name__ == "__main__":
    sys.exit(main())
