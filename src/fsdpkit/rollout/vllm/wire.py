"""What the trainer and its vLLM engine process exchange: framed messages over a socket
pair, and weight buckets in a shared-memory file both map.

[Note: the engine wire]
The engine runs in a process of its own, possibly another Python environment (vLLM
pins its own transformers), so nothing crosses but plain data: each message is a
pickled tuple ``(kind, payload)`` of builtins (str, int, float, list, dict), framed by
an 8-byte length. The channel is an ``AF_UNIX`` socket pair the trainer creates and
hands to the child as an inherited file descriptor: no address, no listener, and the
child reads EOF the moment the trainer is gone.

Weights do not go through the socket: the trainer writes a bucket of tensors into a
``memfd`` (anonymous shared memory, also inherited) and sends only their ``Slot``s
(name, dtype, shape, byte offset); the engine views the same pages, copies each tensor
out and loads it. One bucket is in flight at a time (the engine acknowledges each), so
the file is reused and its size (``rl.vllm_sync_bucket_mb``, or the largest tensor if
larger) bounds the unsharded bytes of a push. This module imports only the standard
library and torch: both environments load it.
"""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64
"""Byte alignment of every tensor in a bucket (any dtype's view is aligned)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The dtypes a push sends, by the name vLLM's ``dtype`` argument takes."""

_HEADER = struct.Struct("<Q")


class EngineGone(ConnectionError):
    """The other end closed the channel (the process exited or was killed)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The ``DTYPES`` name of ``dtype`` (ValueError for others)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"the vLLM engine runs in {', '.join(DTYPES)}, not {dtype}")


def send(sock: socket.socket, kind: str, payload: Any = None) -> None:
    """One message (builtins only: [Note: the engine wire])."""
    data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        sock.sendall(_HEADER.pack(len(data)) + data)
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise EngineGone(str(exc)) from None


def _exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            raise EngineGone("the channel closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> tuple[str, Any]:
    """The next message; EngineGone at EOF. Blocks (the caller sets a timeout on the
    socket to wait less)."""
    (n,) = _HEADER.unpack(_exactly(sock, _HEADER.size))
    kind, payload = pickle.loads(_exactly(sock, n))
    return kind, payload


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in the bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count * DTYPES[self.dtype].itemsize

    def as_tuple(self) -> tuple[str, str, tuple[int, ...], int]:
        return (self.name, self.dtype, self.shape, self.offset)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SharedBucket:
    """A shared-memory file of ``size`` bytes, viewed as a uint8 tensor. The trainer
    creates it (``create``) and passes ``fd`` to the engine, which ``attach``es."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self._map = mmap.mmap(fd, size)
        self.data = torch.frombuffer(self._map, dtype=torch.uint8)
        self.slots: list[Slot] = []
        self.used = 0

    @classmethod
    def create(cls, size: int) -> SharedBucket:
        fd = os.memfd_create("fsdpkit-vllm-bucket")
        os.ftruncate(fd, size)
        return cls(fd, size)

    @classmethod
    def attach(cls, fd: int, size: int) -> SharedBucket:
        return cls(fd, size)

    def fits(self, nbytes: int) -> bool:
        return _aligned(self.used) + nbytes <= self.size

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into the next free bytes (the caller checked ``fits``)."""
        slot = Slot(name, dtype_name(tensor.dtype), tuple(tensor.shape), _aligned(self.used))
        self.view(slot).copy_(tensor.detach().reshape(slot.shape))
        self.slots.append(slot)
        self.used = slot.offset + slot.nbytes

    def view(self, slot: Slot) -> torch.Tensor:
        """The bucket's bytes of ``slot`` as its tensor (no copy)."""
        raw = self.data[slot.offset : slot.offset + slot.nbytes]
        return raw.view(DTYPES[slot.dtype]).view(slot.shape)

    def clear(self) -> None:
        self.slots, self.used = [], 0

    def close(self) -> None:
        del self.data
        self._map.close()
        os.close(self.fd)
