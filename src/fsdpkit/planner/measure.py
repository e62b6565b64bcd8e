"""The true per-rank peak of tensor memory of one training step, on CPU ranks.

[Note: measuring CPU peaks]
c10's CPU allocator keeps a running total of allocated bytes only when asked: the
profiler asks per thread (so a buffer freed on a gloo worker thread is never
subtracted and the count drifts), while the global flag
``FLAGS_caffe2_report_cpu_memory_usage`` (an exported bool in libc10, set here via
ctypes) makes it count every allocation and free of the process. With the flag set
before the model is built, each allocation event the profiler records carries the
process-wide live total, and its maximum over the step is the peak — exactly
repeatable, equal on every rank for symmetric configs, and it includes what a
tracker cannot see (buffers allocated inside gloo collectives). RSS overstates by
1.4-2.1x (allocator caching, libraries) and tracemalloc does not see tensors.
Used by bench/plan_accuracy.py and the accuracy tests to check the planner.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from fsdpkit.config import RunConfig, batch_split, mesh_shape
from fsdpkit.finetune import prepare
from fsdpkit.init import Initializer
from fsdpkit.mesh import build_mesh
from fsdpkit.models.factory import LossFn, next_token_loss
from fsdpkit.models.llama import Llama, LlamaConfig
from fsdpkit.planner.built import build_for_plan, input_vocab, planned_loss
from fsdpkit.sharding import resolve_precision, shard
from fsdpkit.sharding.grads import sync_mode
from fsdpkit.train.optim import build_optimizer
from fsdpkit.train.step import train_step

_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def enable_process_wide_accounting() -> None:
    """Make c10's CPU allocator count every allocation of the process (see note)."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, _FLAG).value = True


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Kineto prints a line on every profiler start/stop straight to fd 2."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def allocation_events(prof: profile) -> list[tuple[int, int, int]]:
    """(time, live total after the event, size) of every allocation event, in order."""
    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            out.append((event.start_time_ns, fields.total_allocated, fields.alloc_size))
    return sorted(out)


def _profiled(fn: Callable[[], object]) -> list[tuple[int, int, int]]:
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return allocation_events(prof)


def live_bytes() -> int:
    """Bytes the process holds in CPU tensors now (needs the flag)."""
    gc.collect()
    events = _profiled(lambda: torch.empty(1024, dtype=torch.uint8))
    _, total, size = events[0]
    return total - size


def peak_bytes(fn: Callable[[], object]) -> int:
    """Highest live CPU tensor bytes while ``fn`` runs (needs the flag)."""
    events = _profiled(fn)
    return max(total for _, total, _ in events) if events else live_bytes()


def measure_step_peaks(
    rank: int,
    world_size: int,
    specs: list[tuple[str, RunConfig, LlamaConfig | None]],
    steps: int = 1,
) -> dict[str, list[int]]:
    """run_ranks worker: for each (name, RunConfig, model shape), the true peak of
    ``steps`` steady-state steps (one number per step) minus what the process held
    before building the model. Shape None: the run's model.hf / model.factory model,
    built by the trainer's builder."""
    enable_process_wide_accounting()
    return {
        name: _step_peaks(cfg, shape, rank=rank, world_size=world_size, steps=steps)
        for name, cfg, shape in specs
    }


def _model(
    cfg: RunConfig, shape: LlamaConfig | None
) -> tuple[nn.Module, Initializer | None, LossFn]:
    """The run's model before sharding (prepared for fine-tuning), its init and loss."""
    precision = resolve_precision(cfg.precision, device_type="cpu")
    if shape is None:
        built = build_for_plan(cfg, vocab=None, precision=precision.name)
        return built.module, built.init, built.loss_fn
    with torch.device("meta"):
        model = Llama(shape)
    tuned = prepare(model, cfg, precision=precision, init=None)  # LoRA / model.freeze
    return model, tuned.init, next_token_loss


def _step_peaks(
    cfg: RunConfig, shape: LlamaConfig | None, *, rank: int, world_size: int, steps: int
) -> list[int]:
    base = live_bytes()
    replicate, shard_degree = mesh_shape(cfg, world_size=world_size, local_world_size=world_size)
    mesh = build_mesh(replicate=replicate, shard=shard_degree, device_type="cpu")
    model, init, loss_fn = _model(cfg, shape)
    vocab = shape.vocab_size if shape is not None else input_vocab(model, default=256)
    shard(model, cfg, mesh=mesh, init=init)
    loss_fn = planned_loss(model, cfg, loss_fn=loss_fn)
    precision = resolve_precision(cfg.precision, device_type="cpu")
    opt = build_optimizer(model, cfg.train, grad_scaler=precision.scaler)  # the trainer's
    gen = torch.Generator().manual_seed(rank)
    split = batch_split(cfg.train, dp_world=world_size)
    size = (split.micro_batch, cfg.data.seq_len + 1)
    batches = [torch.randint(0, vocab, size, generator=gen) for _ in range(split.grad_accum)]

    def step() -> None:
        train_step(
            model,
            opt,
            batches,
            loss_fn=loss_fn,
            max_norm=cfg.train.grad_clip,
            keep_unsharded=cfg.parallel.accum_keep_unsharded,
            accum_sync=sync_mode(cfg.parallel.accum_sync),
        )

    step()  # creates the AdamW states
    return [peak_bytes(step) - base for _ in range(steps)]
