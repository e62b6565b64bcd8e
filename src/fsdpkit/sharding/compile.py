"""``train.compile``: ``torch.compile`` each block, and how long compiling took.

Order (as torchtitan): activation checkpointing -> compile each block -> ``fully_shard``.
Each block is compiled in place (``nn.Module.compile``: names and state-dict keys
unchanged, unlike a wrapping ``OptimizedModule``); blocks of one class share one
compiled graph (dynamo reuses it while the guards hold), so the compile cost is one
block's, not the model's. FSDP2's hooks stay outside the graphs (dynamo skips them).

[Note: checkpointing compiled blocks]
The composable ``checkpoint`` that eager runs use works by module hooks; under
``torch.compile`` those hooks run outside the compiled graph, so the selective
policy's dispatch mode sees only inductor's calls (``mm.out``), not the block's ops,
and saves almost nothing: measured on a 2-block d=256 Llama, 2.5 MiB of activations
kept vs 7.0 MiB eager selective and 1.5 MiB full — selective silently became full.
A compiled block therefore calls ``torch.utils.checkpoint`` inside its forward
(fsdpkit.sharding.activations.checkpoint_forward), which dynamo traces as one
region and whose policy the partitioner applies (6.0 MiB kept: selective as meant).

[Note: blocks whose forward is torch's own]
``nn.Module.compile`` compiles the module's ``_call_impl``; dynamo does not start a
frame in torch's own files, so it compiles the first frame of user code below that:
the block's ``forward``. A block whose ``forward`` is torch's (``nn.Sequential``, a
bare ``nn.Linear`` chosen as the block) has none, and ``.compile()`` compiled nothing
(measured: 0 s of compile time and no graph for an ``nn.Sequential`` of LayerNorm and
Linear, with or without FSDP2). Such a block gets its ``forward`` replaced by a
compiled fsdpkit function that calls it, which dynamo starts a frame in and traces
through (as ``torch.compile(module)`` does with ``external_utils.wrap_inline``).

[Note: compile time]
The first step compiles (forward graphs when first called, backward graphs lazily
at the first backward). ``compile_seconds`` reads dynamo's own timers for both; the
training loop reports each step's share as ``compile_s`` and computes tokens/s from
the step time without it (fsdpkit.train.loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fsdpkit.errors import ConfigError

_TIMERS = ("_compile.compile_inner", "backward._backward_impl")
"""dynamo's timers: tracing + AOT + inductor of a frame; the lazy backward compile."""


def compile_blocks(blocks: Sequence[nn.Module], *, backend: str = "inductor") -> None:
    """``torch.compile`` each block in place ([Note: blocks whose forward is torch's
    own]); ``backend`` is dynamo's (tests use ``aot_eager``, which needs no C++
    compiler)."""
    for block in blocks:
        if _forward_is_torchs(block):
            _compile_forward(block, backend=backend)
        else:
            block.compile(backend=backend)


def _forward_is_torchs(block: nn.Module) -> bool:
    """Whether ``block.forward`` is code in torch's own package, where dynamo starts
    no frame."""
    return (getattr(block.forward, "__module__", None) or "").startswith("torch.")


def _compile_forward(block: nn.Module, *, backend: str) -> None:
    inner = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)

    block.forward = torch.compile(forward, backend=backend)  # type: ignore[method-assign]


def enable_async_tp(*, device_type: str) -> None:
    """``parallel.async_tp``: inductor's micro-pipelined tensor parallelism, which splits
    each all-gather / reduce-scatter around a matmul into chunks overlapped with it
    through symmetric memory (CUDA only; torch 2.13 needs no per-group setup). A
    process-wide inductor setting: every block compiled after this call uses it."""
    if device_type != "cuda":
        raise ConfigError(
            f"parallel.async_tp = true needs CUDA GPUs (NCCL and symmetric memory); this "
            f"run's devices are {device_type!r}. Set parallel.async_tp = false: the "
            "tensor-parallel collectives then run between the matmuls."
        )
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far ([Note: compile time])."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(sum(compilation_time_metrics.get(name, [])) for name in _TIMERS))
