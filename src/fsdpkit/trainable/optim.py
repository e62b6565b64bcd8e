"""Optimizer and learning-rate schedule, built after sharding.

AdamW over the sharded (DTensor) parameters, so optimizer state is sharded too.
Weight decay skips 1-D parameters (norms, biases). The schedule is a LambdaLR:
linear warm-up, then cosine / linear decay to ``min_lr_ratio`` or constant.

[Note: AdamW kernels]
``train.optimizer_impl`` picks one of torch's three AdamW implementations; all three
give the same numbers (tests/distributed/test_accum_prefetch_optimizer_train.py, 1e-5):

- ``for-loop``: one parameter at a time, a handful of small kernels each; the least
  temporary memory (one parameter's worth).
- ``foreach``: multi-tensor kernels over each group; fewer dispatches, but its
  ``sqrt(v)`` step allocates a temporary as large as every 2-D weight of the group.
- ``fused``: one kernel per group that reads and writes each element once, no
  temporaries; CPU (torch >= 2.4) and CUDA, and it works on FSDP2's DTensor shards.

``auto`` is ``fused`` where the parameters (and so the step) live on the CPU —
CPU ranks and ``offload.params`` — and on CUDA: fused was the fastest measured on
offloaded shards (bench/optimizer_step.py, docs/levers.md) and torch names it the
fastest on CUDA; ``foreach`` elsewhere, and under the fp16 gradient scaler: torch
2.13's fused step fails with FSDP2's sharded scaler (its ``found_inf`` has shape [1],
the step counters shape [], and ``_foreach_sub_`` refuses to broadcast), so
``fused`` with a scaler is a config error (fsdpkit.config.validate). The planner
models each one's temporary (fsdpkit.planner.replay.analytic) from ``resolve_impl``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import nn

from fsdpkit.config import TrainConfig

Impl = Literal["for-loop", "foreach", "fused"]
_FUSED_DEVICES = ("cpu", "cuda")


def resolve_impl(impl: str, *, device_type: str, grad_scaler: bool = False) -> Impl:
    """The AdamW kernel ``train.optimizer_impl`` means for parameters on
    ``device_type``, with or without the fp16 gradient scaler (see [Note: AdamW
    kernels])."""
    if impl == "auto":
        return "fused" if device_type in _FUSED_DEVICES and not grad_scaler else "foreach"
    if impl == "fused" and device_type not in _FUSED_DEVICES:
        return "foreach"  # torch has no fused AdamW there
    return impl  # type: ignore[return-value]


def impl_kwargs(impl: Impl) -> dict[str, Any]:
    """torch.optim.AdamW's switches for one implementation."""
    if impl == "fused":
        return {"fused": True}
    return {"foreach": impl == "foreach"}


def param_device_type(params: list[nn.Parameter]) -> str:
    """Where the optimizer step runs: the device of the (local shards of the)
    parameters; the CPU with offload.params. (DTensor is imported here: the planner
    reads ``resolve_impl`` and never builds an optimizer.)"""
    from torch.distributed.tensor import DTensor

    if not params:
        return "cpu"
    p = params[0]
    local = p.to_local() if isinstance(p, DTensor) else p
    return local.device.type


def decay_groups(params: list[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The trainable parameters with weight decay (matrices) and without (1-D: norms,
    biases), in model order: the optimizer's two groups."""
    decay = [p for p in params if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in params if p.requires_grad and p.ndim < 2]
    return decay, no_decay


def group_names(model: nn.Module) -> list[list[str]]:
    """The parameter names of each of ``build_optimizer``'s (non-empty) groups for
    ``model``: a pipelined run's checkpoint lists the whole model's, so that any layout
    finds its parameters' groups ([Note: optimizer groups across stages] in
    fsdpkit.checkpoint.statefuls)."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = decay_groups(list(model.parameters()))
    return [[names[id(p)] for p in group] for group in groups if group]


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, *, grad_scaler: bool = False
) -> torch.optim.AdamW:
    """AdamW on the trainable parameters (frozen ones get no state), with the kernel
    ``train.optimizer_impl`` resolves to for where the parameters live and whether a
    gradient scaler steps it."""
    decay, no_decay = decay_groups(list(model.parameters()))
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    where = param_device_type(decay + no_decay)
    impl = resolve_impl(cfg.optimizer_impl, device_type=where, grad_scaler=grad_scaler)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        **impl_kwargs(impl),
    )


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
