"""Deterministic, world-size independent parameter initialization.

[Note: per-parameter init]
Every parameter is drawn from its own CPU generator seeded by hash(seed, name).
Building the model normally, or materializing one parameter at a time on the meta
device and keeping only the local shard, therefore yields the same numbers at any
world size, and no rank needs the whole model at once (DTensor's RNG is CUDA-only, so
``reset_parameters()`` after ``to_empty`` would give every shard the same values).
A model may define ``param_init(name, shape, generator) -> Tensor`` to choose its
own distributions, and ``init_buffers()`` to recompute non-persistent buffers.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # DTensor costs ~0.5 s to import; the planner reads this module without it
    from torch.distributed.tensor import DTensor

Initializer = Callable[[nn.Module], None]
"""Fills every parameter of a materialized (possibly sharded) model, replacing fsdpkit's
per-parameter init (e.g. loading a Hugging Face directory, or the model's own init)."""


def param_seed(seed: int, name: str) -> int:
    """Generator seed of one parameter: stable across processes and Python runs."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def initial_value(
    model: nn.Module, *, name: str, shape: torch.Size, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """Full initial value of one parameter, on CPU.

    Uses the model's ``param_init`` hook if it has one, else PyTorch-like defaults:
    uniform(+-1/sqrt(fan_in)) for matrices, ones for 1-D weights, zeros for biases.
    """
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    hook = getattr(model, "param_init", None)
    if hook is not None:
        value = hook(name, shape, gen)
    elif len(shape) >= 2:
        bound = 1 / math.sqrt(math.prod(shape[1:]))
        value = torch.empty(shape).uniform_(-bound, bound, generator=gen)
    elif name.endswith("weight"):
        value = torch.ones(shape)
    else:
        value = torch.zeros(shape)
    return value.to(dtype)


def init_buffers(model: nn.Module) -> None:
    """Recompute non-persistent buffers if the model knows how (RoPE tables...)."""
    hook = getattr(model, "init_buffers", None)
    if hook is not None:
        hook()


def default_init(model: nn.Module, *, seed: int) -> None:
    """fsdpkit's per-parameter init of every parameter of a model, sharded or not
    ([Note: per-parameter init]): the rule for a model that is not a transformers
    ``PreTrainedModel``. The public entry point, which picks the rule for any model, is
    ``fsdpkit.init_weights`` (fsdpkit.models.hf.initialize)."""
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied parameters once, first name
            value = initial_value(model, name=name, shape=p.shape, seed=seed, dtype=p.dtype)
            copy_full_value(p, value)


def run_init(model: nn.Module, *, init: Initializer | None, seed: int) -> None:
    """Fill every parameter with ``init(model)``, or fsdpkit's per-parameter init when
    None, then the model's non-persistent buffers (``init_buffers``): the last step of
    both ``fsdpkit.shard``'s materialization and ``fsdpkit.init_weights``."""
    with torch.no_grad():
        if init is None:
            default_init(model, seed=seed)
        else:
            init(model)
        init_buffers(model)


def _local_slice(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        full.shape, param.device_mesh, param.placements
    )
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return full[index]


def copy_full_value(param: torch.Tensor, full: torch.Tensor) -> None:
    """Set a (possibly sharded) parameter from its full, unsharded value: a DTensor
    keeps only this rank's slice."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            local = param.to_local()
            local.copy_(_local_slice(full, param).to(local.device))
        else:
            param.copy_(full.to(param.device))
