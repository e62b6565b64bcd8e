"""Reading checkpoints that may come from someone else, without running their code.

[Note: untrusted checkpoints]
DCP stores its index (``.metadata``) and every non-tensor value as pickles, and its
own reader unpickles them with ``pickle.load`` / ``torch.load(weights_only=False)``:
a crafted checkpoint runs any code it likes on load. fsdpkit never does that:

1. ``.metadata`` is unpickled only if its bytes match the size and crc32 that
   fsdpkit.json recorded at save time (a damaged or swapped file is refused before
   any byte of it is interpreted), and
2. even then only with ``MetadataUnpickler``, which builds DCP's own metadata
   classes, ``torch.Size``, dtypes, layouts and paths, and refuses every other global
   (``os.system``, ``builtins.eval``, ...) with ``UnsafeCheckpointError``.
3. Non-tensor values are loaded with ``torch.load(weights_only=True)`` (containers,
   numbers, strings, tensors; no code) by ``SafeLoadPlanner``; fsdpkit's own state is
   tensors anyway (fsdpkit.checkpoint.statefuls, fsdpkit.train.state).

The checksum alone is no protection (anyone who can write ``.metadata`` can rewrite
fsdpkit.json); the restricted unpickler is. The checksum makes a damaged file an
error that names the file instead of an unpickling crash.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from fsdpkit.checkpoint.checksum import crc32, hex32
from fsdpkit.checkpoint.errors import CheckpointError

DCP_METADATA = ".metadata"

_ALLOWED: dict[str, dict[str, Any]] = {
    "torch.distributed.checkpoint.metadata": {
        name: getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo": _StorageInfo},
    "torch": {"Size": torch.Size},
    "torch.serialization": {"_get_layout": torch.serialization._get_layout},
    "pathlib": {"PosixPath": pathlib.PurePosixPath, "PurePosixPath": pathlib.PurePosixPath},
    "collections": {"OrderedDict": __import__("collections").OrderedDict},
}


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks to build something other than checkpoint metadata."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata`` and nothing else ([Note: untrusted checkpoints])."""

    def __init__(self, file: Any, *, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get(module, {})
        if name in allowed:
            return allowed[name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._source} asks to load {module}.{name}, which is not part of DCP's "
            "checkpoint metadata; fsdpkit refuses to unpickle it (a crafted or foreign "
            "file could run code this way). Use only checkpoints from a source you trust, "
            "or re-save it with fsdpkit."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._source} holds a persistent reference; refused.")


def metadata_from_bytes(data: bytes, *, source: str) -> Metadata:
    """``Metadata`` from ``.metadata`` bytes via ``MetadataUnpickler``; anything else
    (garbage, truncation, a foreign object) becomes one CheckpointError."""
    try:
        md = MetadataUnpickler(io.BytesIO(data), source=source).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{source} cannot be read as DCP metadata ({type(exc).__name__}: {exc}); the "
            "file is damaged or not a DCP checkpoint index. Pick another checkpoint "
            "(`fsdpkit ckpt list RUN_DIR`)."
        ) from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{source} holds a {type(md).__name__}, not DCP metadata.")
    return md


def read_metadata(ckpt: Path, meta: dict[str, Any]) -> Metadata:
    """The checkpoint's DCP ``Metadata``, checked against fsdpkit.json's record first
    ([Note: untrusted checkpoints]); CheckpointError naming the file otherwise."""
    path = Path(ckpt) / DCP_METADATA
    record = meta.get("files", {}).get(DCP_METADATA)
    if not isinstance(record, dict) or "crc32" not in record or "bytes" not in record:
        raise CheckpointError(
            f"{Path(ckpt) / 'fsdpkit.json'} records no checksum for {DCP_METADATA}, so "
            f"{path} cannot be checked before it is unpickled; refusing to read it. "
            "Re-save the checkpoint with fsdpkit."
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}.") from None
    if len(data) != int(record["bytes"]) or hex32(crc32(data, 0)) != record["crc32"]:
        raise CheckpointError(
            f"{path} does not match the size and crc32 recorded in fsdpkit.json at save "
            f"time ({len(data)} bytes, crc32 {hex32(crc32(data, 0))}; expected "
            f"{record['bytes']} bytes, crc32 {record['crc32']}): it was damaged or "
            "replaced, so fsdpkit will not unpickle it. Pick another checkpoint "
            "(`fsdpkit ckpt list RUN_DIR`) or restore the file."
        )
    return metadata_from_bytes(data, source=str(path))


def load_object(value: io.BytesIO, *, key: str) -> Any:
    """A non-tensor checkpoint value, unpickled with ``torch.load(weights_only=True)``."""
    try:
        return torch.load(value, weights_only=True)
    except Exception as exc:
        raise UnsafeCheckpointError(
            f"checkpoint entry {key!r} is a pickled object that fsdpkit does not load "
            f"safely ({type(exc).__name__}: {str(exc).splitlines()[0]}): only containers, "
            "numbers, strings and tensors are read from checkpoints. Use only checkpoints "
            "from a source you trust; checkpoints of older fsdpkit versions with NumPy "
            "RNG state cannot be resumed (start from `fsdpkit ckpt export` weights instead)."
        ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor values read by ``load_object``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_object(value, key=fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class RestrictedReader(FileSystemReader):
    """DCP's ``FileSystemReader`` for checkpoints fsdpkit did not write (no
    fsdpkit.json to check the bytes against, e.g. an FSDP1 checkpoint): ``.metadata``
    goes through ``MetadataUnpickler`` instead of ``pickle.load``. Pair it with
    ``SafeLoadPlanner`` so non-tensor values are read without executing code either."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = metadata_from_bytes(stream.read(), source=str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata
