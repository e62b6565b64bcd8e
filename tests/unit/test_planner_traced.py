"""Traced planning (the real model code on a fake process group) against analytic.

Each trace builds the sharded model under FakeTensorMode and runs one step under
FSDPMemTracker in this process (~1 s each here); the fake group is gone afterwards.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from fsdpkit.config import load
from fsdpkit.planner import parse_device, plan

# foreach AdamW: its temporary is the optimizer phase's peak. With fused (no temporary)
# the GPU-device trace of the tied full-shard case reads 2 MiB (the tied embedding's
# size) over the analytic plan at the start of that phase; the CPU-device trace and
# real gloo runs do not (bench/plan_accuracy.py "A M opt fused +AC").
SMALL = [
    "model.vocab_size=2048", "data.seq_len=128", "train.micro_batch_size=4",
    "precision.mode=fp32", "train.optimizer_impl=foreach",
]  # fmt: skip


@pytest.mark.parametrize(
    ("world", "overrides"),
    [
        (2, ["parallel.strategy=replicate"]),
        (2, ["activations.mode=full"]),
        (2, ["parallel.strategy=grad_op", "train.grad_accum=2"]),
        (4, ["parallel.strategy=hybrid", "parallel.shard_degree=2", "activations.mode=full"]),
        (4, ["parallel.reshard_after_forward=2"]),
        (1, ["activations.mode=every", "precision.mode=bf16"]),
    ],
)
def test_traced_agrees_with_analytic(world: int, overrides: list[str]) -> None:
    # gloo's hidden collective buffers are not modeled on a GPU device (NCCL has none),
    # so both modes plan exactly the same thing there
    cfg = load(None, [*SMALL, *overrides])
    device = parse_device("cpu:8GiB") if world == 1 else parse_device("80GiB")
    traced = plan(cfg, world_size=world, device=device, trace=True)
    analytic = traced.other
    assert analytic is not None and traced.memory.mode == "traced"
    assert traced.memory.peak.bytes == pytest.approx(analytic.peak.bytes, rel=0.01)
    for phase, peak in analytic.phase_peaks.items():
        # an int reshard_after_forward's post-forward shard (a clone) is counted ~4%
        # higher by the tracker in forward than a real run shows (measured: bench/)
        assert traced.memory.phase_peaks[phase] == pytest.approx(peak, rel=0.05), phase
    assert not dist.is_initialized()
