"""Staging for async saves: host copies of the state, allocated once and reused.

[Note: staging buffers]
An async save must copy the state before training changes it again; that copy is all
it may block for. ``Stager`` keeps one host buffer per tensor (pinned on CUDA, so the
device-to-host copies run at full PCIe speed without a bounce buffer) and copies into
the same buffers on every save. Allocating fresh buffers per save costs a page fault
per 4 KiB on the host (measured: most of the old 0.25 s block on a 0.75 GB
checkpoint) and makes allocator churn. The buffers are re-made only when the state's
structure changes (another key, shape or dtype). Reuse is safe because at most one
save is in flight: ``Checkpointer.save`` waits for the previous one before staging.
The buffers hold one full copy of this rank's checkpoint share in host memory for the
life of the run: ``nbytes`` reports it, and ``async_staging_bytes`` estimates it for
the planner.

Why not DCP's ``DefaultStager``, which also caches host copies: on every save it
rebuilds each tensor and DTensor wrapper and byte-copies whole storages, and it blocked
async saves longer than an A/A control's spread allows (``bench/checkpoint_staging.py``;
docs/checkpoints.md, "Async staging").
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _signature(obj: Any, path: str = "") -> list[tuple[Any, ...]]:
    """The structure the buffers must match: key paths, tensor shapes and dtypes."""
    if isinstance(obj, DTensor):
        obj = obj._local_tensor
    if isinstance(obj, torch.Tensor):
        return [(path, tuple(obj.shape), obj.dtype)]
    if isinstance(obj, Mapping):
        return [s for k in sorted(obj, key=str) for s in _signature(obj[k], f"{path}.{k}")]
    if isinstance(obj, list | tuple):
        return [s for i, v in enumerate(obj) for s in _signature(v, f"{path}[{i}]")]
    return [(path, type(obj).__name__)]


def tensor_bytes(obj: Any) -> int:
    """Bytes of every (local) tensor in a nested state dict."""
    if isinstance(obj, DTensor):
        obj = obj._local_tensor
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _host_like(t: torch.Tensor, *, pin: bool) -> torch.Tensor:
    if isinstance(t, DTensor):
        local = _host_like(t.to_local(), pin=pin)
        if t.device.type == "cpu":
            return DTensor.from_local(
                local,
                t.device_mesh,
                t.placements,
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
        # from_local would move the buffer to the mesh's device: build the host DTensor
        # the way DCP's own stager does (once per run), then give it the pinned buffer
        host: Any = t.to("cpu")
        host._local_tensor = local
        return host
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu", pin_memory=pin)


def _allocate(obj: Any, *, pin: bool) -> Any:
    """Host buffers shaped like every tensor in ``obj`` (containers mirrored)."""
    if isinstance(obj, torch.Tensor):
        return _host_like(obj, pin=pin)
    if isinstance(obj, Mapping):
        return {k: _allocate(v, pin=pin) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_allocate(v, pin=pin) for v in obj]
    return None


def _copy(src: Any, buf: Any, *, non_blocking: bool) -> Any:
    """``src`` with every tensor copied into its buffer; other values as they are."""
    if isinstance(src, torch.Tensor):
        target = buf.to_local() if isinstance(buf, DTensor) else buf
        source = src.to_local() if isinstance(src, DTensor) else src
        target.copy_(source.detach(), non_blocking=non_blocking)
        return buf
    if isinstance(src, Mapping):
        return {k: _copy(v, buf[k], non_blocking=non_blocking) for k, v in src.items()}
    if isinstance(src, list | tuple):
        out = [_copy(v, b, non_blocking=non_blocking) for v, b in zip(src, buf)]
        return tuple(out) if isinstance(src, tuple) else out
    if src is None or isinstance(src, int | float | str | bytes | bool):
        return src
    return copy.deepcopy(src)  # an object training may still mutate


class Stager:
    """Copies a state dict into reused host buffers ([Note: staging buffers])."""

    def __init__(self) -> None:
        self._buffers: Any = None
        self._signature: list[tuple[Any, ...]] = []
        self.allocations = 0
        """How many times buffers were (re)allocated; 1 in a steady run."""

    @property
    def nbytes(self) -> int:
        """Host memory the buffers hold (0 before the first async save)."""
        return tensor_bytes(self._buffers)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` (tensors in the reused buffers; other values as
        they are, containers rebuilt). Blocks until the copies are done."""
        on_device = torch.cuda.is_available()
        signature = _signature(state_dict)
        if self._buffers is None or signature != self._signature:
            self._buffers = None  # free the old buffers before allocating new ones
            self._buffers = _allocate(state_dict, pin=on_device)
            self._signature = signature
            self.allocations += 1
        with torch.no_grad():
            staged = _copy(state_dict, self._buffers, non_blocking=on_device)
        if on_device:
            torch.cuda.synchronize()
        return staged

    def close(self) -> None:
        self._buffers = None
        self._signature = []


def async_staging_bytes(model_states: Mapping[str, int]) -> int:
    """Host bytes per rank that async checkpointing keeps for its staging buffers, from
    the planner's per-rank ``model_states`` (sharded params + optimizer states; the
    gradients are not checkpointed). For the planner's host-memory line."""
    return int(model_states.get("sharded_params", 0)) + int(model_states.get("optimizer_states", 0))
