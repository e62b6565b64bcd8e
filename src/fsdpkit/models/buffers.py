"""Buffers of meta-built models: keep what the constructor computed, never train on garbage.

[Note: buffers of meta models]
``to_empty()`` replaces every parameter *and every buffer* of a meta model with
uninitialized memory. Parameters are then loaded or initialized, but non-persistent
buffers (RoPE ``inv_freq``, position ids, causal masks, embedding scales) are in no
checkpoint: left alone they hold whatever the allocator returned, and the model trains
on garbage without a single error (seen: a wrong step-0 loss; once NaN on every step
with exit 0). A buffer therefore gets its value from, in order:

1. the model's own constructor: build under ``meta_params()`` (parameters on the meta
   device, buffers computed by the constructor on the CPU; buffers are small). Real
   buffers are kept across materialization (``kept_buffers`` / ``restore_buffers``).
2. the model's ``init_buffers()`` hook, called after materialization (fsdpkit's
   built-in models).
3. for a Hugging Face ``PreTrainedModel`` built entirely on meta: the model's own
   ``_init_weights``, which re-creates them in transformers 5 (``fsdpkit.models.hf.initialize``).

Materialization then checks that every buffer that was on meta was written; one that
was not is an ``UninitializedBufferError`` naming it, before any step runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fsdpkit.errors import UserError

BufferKey = tuple[int, str]
"""(id of the owning module, buffer name in that module)."""


class UninitializedBufferError(UserError):
    """A buffer of a meta-built model would start training as uninitialized memory."""


@contextmanager
def meta_params() -> Iterator[None]:
    """Build a model with its parameters on the meta device and its buffers computed
    by its constructor on the CPU (the pattern of accelerate's
    ``init_empty_weights(include_buffers=False)``).

    Each parameter is created as the constructor creates it and moved to meta as it is
    registered, so at most one parameter's storage exists at a time (and an
    ``nn.Linear``'s ``torch.empty`` never touches its pages). Parameters that are
    already on meta are kept as they are, so ``tie_weights`` keeps ties intact.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _buffers(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    for mod_name, module in model.named_modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                yield (f"{mod_name}.{key}" if mod_name else key), module, key, buf


def meta_buffers(model: nn.Module) -> list[str]:
    """Names of the buffers that are on the meta device (no values)."""
    return [name for name, _, _, buf in _buffers(model) if buf.is_meta]


def kept_buffers(model: nn.Module) -> dict[BufferKey, torch.Tensor]:
    """The buffers that hold real values, to put back after ``to_empty``."""
    return {(id(m), key): buf for _, m, key, buf in _buffers(model) if not buf.is_meta}


def restore_buffers(model: nn.Module, kept: dict[BufferKey, torch.Tensor]) -> None:
    """Copy the kept values into the (re-allocated) buffers, on the buffers' device."""
    with torch.no_grad():
        for _, module, key, buf in _buffers(model):
            value = kept.get((id(module), key))
            if value is not None:
                buf.copy_(value.to(buf.device))


Stamp = tuple[torch.Tensor | None, int]
"""A tensor and its in-place version counter at one moment."""


def stamp(t: torch.Tensor | None) -> Stamp:
    """Remember ``t`` (holding a reference, so its identity cannot be reused)."""
    return (t, t._version if t is not None else -1)


def unchanged(t: torch.Tensor | None, before: Stamp) -> bool:
    """Whether ``t`` is the same tensor as at ``before`` and was not written in place."""
    return t is before[0] and (t is None or t._version == before[1])


def fresh_versions(model: nn.Module, *, kept: dict[BufferKey, torch.Tensor]) -> dict[str, Stamp]:
    """Stamps of the buffers ``to_empty`` just allocated and no value will be restored
    to: ``require_written`` later sees whether anything wrote them."""
    return {name: stamp(buf) for name, m, key, buf in _buffers(model) if (id(m), key) not in kept}


def require_written(model: nn.Module, fresh: dict[str, Stamp]) -> None:
    """Raise if a buffer is still what ``to_empty`` left (no in-place write, not replaced)."""
    now = {name: buf for name, _, _, buf in _buffers(model)}
    stale = [name for name, before in fresh.items() if unchanged(now.get(name), before)]
    if stale:
        raise UninitializedBufferError(_stale_message(stale, when="after materialization"))


def require_buffer_source(model: nn.Module) -> None:
    """Refuse, before anything is sharded, a meta-built model whose meta buffers nothing
    can re-create (no ``init_buffers`` hook): see [Note: buffers of meta models]."""
    if getattr(model, "init_buffers", None) is not None:
        return
    stale = meta_buffers(model)
    if stale:
        raise UninitializedBufferError(_stale_message(stale, when="on the meta device"))


def _stale_message(names: list[str], *, when: str) -> str:
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return (
        f"the model's buffers {shown} are {when} with no value: materializing a meta model "
        "allocates them uninitialized, and nothing in a checkpoint restores non-persistent "
        "buffers, so training would silently use garbage. Build the model under "
        "`fsdpkit.meta_params()` instead of `torch.device('meta')` (parameters on meta, "
        "buffers computed by the constructor), build it on the CPU (model.meta_init does not "
        "apply to factories), or give the model an `init_buffers(self)` method that "
        "recomputes them."
    )
