"""Meta-device models: allocate only local shards and fill them deterministically.

See [Note: per-parameter init] in fsdpkit.init: each rank computes the full initial
value of one parameter at a time and keeps only its own slice, so the result equals
a normal build with the same seed at any world size. Buffers follow
[Note: buffers of meta models] in fsdpkit.models.buffers: real ones are kept across
``to_empty``, and one left uninitialized is an error.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdpkit.init import Initializer, run_init
from fsdpkit.models.buffers import fresh_versions, kept_buffers, require_written, restore_buffers


def is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def materialize(
    model: nn.Module,
    *,
    seed: int,
    param_device: torch.device,
    buffer_device: torch.device,
    init: Initializer | None = None,
) -> None:
    """Allocate the (sharded) meta model on ``param_device`` and initialize it:
    ``init(model)`` if given, else fsdpkit's per-parameter init from ``seed``."""
    kept = kept_buffers(model)
    model.to_empty(device=param_device)
    if buffer_device != param_device:  # CPU offload on a GPU: buffers stay on the GPU
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to(buffer_device)
    fresh = fresh_versions(model, kept=kept)
    restore_buffers(model, kept)
    run_init(model, init=init, seed=seed)
    require_written(model, fresh)
