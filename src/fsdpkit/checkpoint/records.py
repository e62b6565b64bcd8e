"""Where a tensor's bytes sit inside one DCP item, without ``torch.load``.

DCP's file writer stores each tensor item as a ``torch.save`` zip: ``data.pkl`` first
(dtype, shape, strides), a few small records, ``data/<key>`` holding the storage's raw
bytes (uncompressed, 64-byte aligned), then the central directory. DCP's reader
``torch.load``s every item: a fresh storage (a page fault per 4 KiB), a copy into it,
then a second copy into the target. ``tensor_record`` reads only the item's first
``HEAD`` bytes: ``data.pkl`` (with an unpickler that admits only torch's tensor-rebuild
function, storage types and ``OrderedDict``) and the local header of ``data/<key>``,
found by its exact name, so the reader can put the payload bytes straight into the
target tensor and read each item front to back. Anything unexpected returns None and
the reader falls back to ``torch.load(weights_only=True)`` on the whole item.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

HEAD = 4096
"""Bytes read from an item's start to locate its tensor (~700 for one tensor)."""
_LOCAL = struct.Struct("<4s22sHH")  # signature, fixed fields, name length, extra length
_SIG = b"PK\x03\x04"
ReadAt = Callable[[int, int], bytes]
"""``read_at(offset, n)``: ``n`` bytes of the item starting at ``offset``."""


@dataclass(frozen=True)
class TensorRecord:
    """One saved tensor: its payload's offset in the item and how to view it."""

    payload: int
    """Offset of the storage bytes from the start of the item."""
    dtype: torch.dtype
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dense(self) -> bool:
        """Row-major contiguous and covering its whole storage from element 0."""
        return (
            self.storage_offset == 0
            and self.stride == contiguous_strides(self.size)
            and math.prod(self.size) == self.storage_numel
        )

    def view(self, item: memoryview) -> torch.Tensor:
        """The tensor as a view into ``item`` (the item's bytes in memory), no copy."""
        nbytes = self.storage_numel * self.dtype.itemsize
        if nbytes == 0:
            return torch.empty(self.size, dtype=self.dtype)
        flat = torch.frombuffer(item, dtype=torch.uint8, count=nbytes, offset=self.payload)
        return flat.view(self.dtype).as_strided(self.size, self.stride, self.storage_offset)


def contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def dense_span(
    size: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> tuple[int, int] | None:
    """(first element, count) of the box ``offsets``/``lengths`` in a row-major tensor
    of ``size`` when the box is one contiguous run of elements, else None."""
    partial = next((i for i, (n, k) in enumerate(zip(size, lengths)) if k != n), len(size))
    if any(n != 1 for n in size[:partial]) and partial < len(size):
        return None
    if any(k != n for n, k in zip(size[partial + 1 :], lengths[partial + 1 :])):
        return None
    strides = contiguous_strides(size)
    return sum(o * s for o, s in zip(offsets, strides)), math.prod(lengths)


def _storage_dtype(name: str) -> torch.dtype:
    from torch.storage import _get_dtype_from_pickle_storage_type

    return _get_dtype_from_pickle_storage_type(name)


def _rebuild(storage: Any, offset: int, size: Any, stride: Any, *rest: Any) -> dict[str, Any]:
    if not isinstance(storage, dict):
        raise pickle.UnpicklingError("unexpected storage reference")
    return {**storage, "offset": int(offset), "size": tuple(size), "stride": tuple(stride)}


class _TensorHeader(pickle.Unpickler):
    """Unpickles a torch.save ``data.pkl`` of one plain tensor into a description."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return _storage_dtype(name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a plain tensor")

    def persistent_load(self, pid: Any) -> Any:
        kind, dtype, key, location, numel = pid
        if kind != "storage" or location != "cpu" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError("unexpected storage")
        return {"key": str(key), "dtype": dtype, "numel": int(numel)}


def _local(head: bytes, pos: int) -> tuple[str, int] | None:
    """(name, data offset) of the zip local header at ``pos``, if one is there."""
    if pos + _LOCAL.size > len(head):
        return None
    sig, _, name_len, extra_len = _LOCAL.unpack_from(head, pos)
    start = pos + _LOCAL.size
    if sig != _SIG or start + name_len > len(head):
        return None
    try:
        name = head[start : start + name_len].decode()
    except UnicodeDecodeError:
        return None
    return name, start + name_len + extra_len


def _member(head: bytes, name: str, after: int) -> int | None:
    """Data offset of the record called ``name``: the first local header at or after
    ``after`` that carries exactly that name."""
    pos = head.find(_SIG, after)
    while pos >= 0:
        found = _local(head, pos)
        if found is not None and found[0] == name:
            return found[1]
        pos = head.find(_SIG, pos + 1)
    return None


def tensor_record(read_at: ReadAt, length: int) -> TensorRecord | None:
    """Describe the tensor ``torch.save`` wrote in an item of ``length`` bytes, or None
    if the item is anything but one plain little-endian CPU tensor."""
    if sys.byteorder != "little":
        return None
    head = read_at(0, min(length, HEAD))
    first = _local(head, 0)
    if first is None or not first[0].endswith("data.pkl"):
        return None
    prefix, pkl = first[0][: -len("data.pkl")], io.BytesIO(head[first[1] :])
    try:
        desc = _TensorHeader(pkl).load()
    except Exception:
        return None
    if not isinstance(desc, dict) or "size" not in desc:
        return None
    after = first[1] + pkl.tell()
    order = _member(head, f"{prefix}byteorder", after)
    if order is not None and head[order : order + 3] != b"lit":
        return None
    payload = _member(head, f"{prefix}data/{desc['key']}", after)
    if payload is None or payload + desc["numel"] * desc["dtype"].itemsize > length:
        return None
    return TensorRecord(
        payload=payload,
        dtype=desc["dtype"],
        storage_numel=desc["numel"],
        storage_offset=desc["offset"],
        size=desc["size"],
        stride=desc["stride"],
    )
