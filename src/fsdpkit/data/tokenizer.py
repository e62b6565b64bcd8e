"""Tokenizers: byte-level by default, a Hugging Face ``tokenizer.json`` on request.

The byte tokenizer needs nothing installed and has a fixed vocabulary of 256, so the
built-in run works on any machine. A ``tokenizer.json`` is loaded with the ``tokenizers``
package (it ships with ``transformers``) from a local file or directory; nothing is ever
downloaded.

Both concrete tokenizers also implement the bulk path of ``BulkEncoder``: ``encode_many``
(a list of texts to token arrays in one call: the Rust batch API for HF tokenizers, a numpy
view of the bytes for the byte tokenizer) and ``fingerprint`` (what a prepared dataset
records, so that data tokenized with one tokenizer is never trained with another).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from fsdpkit.config import DataConfig
from fsdpkit.data.errors import DataError

DOC_SEPARATOR = "\n\n"
"""Text placed between documents when the tokenizer has no end-of-sequence token."""

_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
"""End-of-text tokens of common tokenizer families, tried when no tokenizer_config.json
names one."""


class Tokenizer(Protocol):
    """What the data pipeline and the training loop need from a tokenizer."""

    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@runtime_checkable
class BulkEncoder(Protocol):
    """A tokenizer with a batch path and an identity (what ``prepare`` needs)."""

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def fingerprint(self) -> dict[str, Any]: ...


def separator_ids(tokenizer: Tokenizer) -> list[int]:
    """What goes between two documents: the EOS token if there is one, else a blank line."""
    if tokenizer.eos_id is not None:
        return [tokenizer.eos_id]
    return tokenizer.encode(DOC_SEPARATOR)


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocab 256); decoding replaces invalid byte sequences."""

    vocab_size: int = 256
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's UTF-8 bytes as a uint8 array (a view, no per-token Python object)."""
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def encode_documents(self, docs: Sequence[str]) -> torch.Tensor:
        """Every document followed by the separator, as one int64 tensor."""
        return join_documents(self, docs)

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "byte", "fingerprint": "byte-utf8", "vocab_size": 256, "eos_id": None}


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from a local ``tokenizer.json``.

    Special tokens (BOS and the like) are not added per document: the documents are
    packed into one stream, separated by the end-of-sequence token when there is one.
    """

    def __init__(self, tok: Any, *, eos_id: int | None, source: Path) -> None:
        self._tok = tok
        self.source = source
        self.vocab_size: int = int(tok.get_vocab_size(with_added_tokens=True))
        self.eos_id: int | None = eos_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The Rust batch API (parallel over texts), each result as a uint32 array."""
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(enc.ids, dtype=np.uint32) for enc in encodings]

    def encode_documents(self, docs: Sequence[str]) -> torch.Tensor:
        """Every document followed by the separator (EOS or a blank line), int64."""
        return join_documents(self, docs)

    def fingerprint(self) -> dict[str, Any]:
        """sha256 of the tokenizer.json's canonical JSON (whitespace and key order do not
        count), with the vocabulary size, EOS id and where it was read."""
        return {
            "kind": "hf",
            "fingerprint": tokenizer_json_hash(self.source),
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "path": str(self.source),
        }


def tokenizer_json_hash(file: Path) -> str:
    """``sha256:<hex>`` of a tokenizer.json's content as canonical JSON."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read the tokenizer {file} ({exc}).") from exc
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def join_documents(tokenizer: BulkEncoder, docs: Sequence[str]) -> torch.Tensor:
    """Each document's ids followed by ``separator_ids`` (what a prepared text stream holds)."""
    sep = np.asarray(separator_ids(tokenizer), dtype=np.int64)  # type: ignore[arg-type]
    parts: list[np.ndarray] = []
    for ids in tokenizer.encode_many(docs):
        parts += [ids.astype(np.int64), sep]
    if not parts:
        return torch.empty(0, dtype=torch.int64)
    return torch.from_numpy(np.concatenate(parts))


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer ``cfg.tokenizer`` names, or the byte tokenizer when it is empty."""
    if not cfg.tokenizer:
        return ByteTokenizer()
    return load_hf_tokenizer(Path(cfg.tokenizer).expanduser())


def load_hf_tokenizer(path: Path) -> HFTokenizer:
    """Load ``tokenizer.json`` from ``path`` (the file itself or a directory holding it)."""
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        where = (
            f"directory {path} has no tokenizer.json" if path.is_dir() else f"{path} does not exist"
        )
        raise DataError(
            f"data.tokenizer: {where}. Point data.tokenizer at a Hugging Face tokenizer.json "
            "or the directory that holds it (for example a model saved with "
            "save_pretrained), or leave it empty for the byte-level tokenizer."
        )
    try:
        from tokenizers import Tokenizer as _RustTokenizer
    except ImportError as e:
        raise DataError(
            f"data.tokenizer is set ({file}) but the 'tokenizers' package is not installed. "
            "Run `pip install tokenizers` (it also comes with `pip install fsdpkit[hf]`), "
            "or leave data.tokenizer empty for the byte-level tokenizer."
        ) from e
    try:
        tok = _RustTokenizer.from_file(str(file))
    except Exception as e:
        raise DataError(
            f"data.tokenizer: {file} could not be read as a Hugging Face tokenizer.json "
            f"({type(e).__name__}: {e}). Check that the file is complete and was written by "
            "the `tokenizers` library (tokenizer.save or save_pretrained)."
        ) from e
    return HFTokenizer(tok, eos_id=_find_eos_id(tok, file.parent), source=file)


def _find_eos_id(tok: Any, directory: Path) -> int | None:
    """The EOS id named by a sibling tokenizer_config.json, else a well-known EOS token."""
    name = _configured_eos_token(directory / "tokenizer_config.json")
    for candidate in (name, *_EOS_CANDIDATES):
        if candidate is None:
            continue
        token_id = tok.token_to_id(candidate)
        if token_id is not None:
            return int(token_id)
    return None


def _configured_eos_token(config_file: Path) -> str | None:
    """``eos_token`` from tokenizer_config.json (a string or {"content": ...}), if any."""
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    eos = data.get("eos_token") if isinstance(data, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None
