"""Where a tensor's bytes sit inside one DCP item, without ``torch.load``.

DCP's file writer stores each tensor item as a ``torch.save`` zip (``data.pkl`` saying
dtype/shape/strides, then ``data/0`` holding the storage's raw bytes, uncompressed and
64-byte aligned, then the central directory). DCP's reader ``torch.load``s every item:
a fresh storage (a page fault per 4 KiB), a copy into it, then a second copy into the
target. ``tensor_record`` instead reads the zip's central directory and ``data.pkl``
(with an unpickler that admits only torch's tensor-rebuild function, storage types and
``OrderedDict``), so the reader can put the payload bytes straight into the target
tensor. Anything unexpected returns None and the reader falls back to
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TAIL = 4096
"""Bytes read from an item's end to find its central directory (~1 KiB for one tensor)."""
_LOCAL = struct.Struct("<4s22sHH")  # signature, fixed fields, name length, extra length
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


class _TailFile(io.RawIOBase):
    """A seekable file of ``length`` bytes of which only the last ``len(tail)`` are known:
    enough for ``zipfile`` to read the end record and central directory."""

    def __init__(self, tail: bytes, length: int) -> None:
        super().__init__()
        self._tail, self._start, self._length, self._pos = tail, length - len(tail), length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        if self._pos < self._start:
            raise OSError("outside the item tail")
        end = self._length if n is None or n < 0 else min(self._pos + n, self._length)
        out = self._tail[self._pos - self._start : end - self._start]
        self._pos = end
        return bytes(out)


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


def _members(read_at: ReadAt, length: int) -> dict[str, zipfile.ZipInfo]:
    n = min(length, TAIL)
    with zipfile.ZipFile(_TailFile(read_at(length - n, n), length)) as zf:
        return {info.filename.split("/", 1)[-1]: info for info in zf.infolist()}


def _data_offset(read_at: ReadAt, info: zipfile.ZipInfo) -> int:
    sig, _, name_len, extra_len = _LOCAL.unpack(read_at(info.header_offset, _LOCAL.size))
    if sig != b"PK\x03\x04" or info.compress_type != zipfile.ZIP_STORED:
        raise ValueError("not a stored zip member")
    return info.header_offset + _LOCAL.size + name_len + extra_len


def tensor_record(read_at: ReadAt, length: int) -> TensorRecord | None:
    """Describe the tensor ``torch.save`` wrote in an item of ``length`` bytes, or None
    if the item is anything but one plain little-endian CPU tensor."""
    if sys.byteorder != "little" or length < 64:
        return None
    try:
        members = _members(read_at, length)
        order = members.get("byteorder")
        if (
            order is not None
            and read_at(_data_offset(read_at, order), order.file_size) != b"little"
        ):
            return None
        pkl = members["data.pkl"]
        header = _TensorHeader(io.BytesIO(read_at(_data_offset(read_at, pkl), pkl.file_size)))
        desc = header.load()
        data = members[f"data/{desc['key']}"]
        if data.file_size != desc["numel"] * desc["dtype"].itemsize:
            return None
        return TensorRecord(
            payload=_data_offset(read_at, data),
            dtype=desc["dtype"],
            storage_numel=desc["numel"],
            storage_offset=desc["offset"],
            size=desc["size"],
            stride=desc["stride"],
        )
    except Exception:
        return None
