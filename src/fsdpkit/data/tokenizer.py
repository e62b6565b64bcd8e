"""Tokenizers: byte-level by default, a Hugging Face ``tokenizer.json`` on request.

The byte tokenizer needs nothing installed and has a fixed vocabulary of 256, so the
built-in run works on any machine. A ``tokenizer.json`` is loaded with the ``tokenizers``
package (it ships with ``transformers``) from a local file or directory; nothing is ever
downloaded.

Both concrete tokenizers also implement the bulk path of ``BulkEncoder``: ``encode_many``
(a list of texts to token arrays in one call: the Rust batch API for HF tokenizers, a numpy
view of the bytes for the byte tokenizer) and ``fingerprint`` (what a prepared dataset
records, so that data tokenized with one tokenizer is never trained with another).

[Note: special tokens]
``encode`` never adds special tokens; what a row starts and ends with is decided here,
once, as the tokenizer itself defines it (and as TRL's trainers tokenize):

- BOS: ``bos_ids`` are the tokens the tokenizer's own encode puts before a text (its
  tokenizer.json post-processor, which is what transformers' ``tokenizer(text)`` adds):
  Llama 3's ``<|begin_of_text|>``, nothing for Qwen2.5 or the byte tokenizer.
  ``with_bos`` puts them before every plain document and every string prompt, unless
  the text already starts with them: never twice. A chat row gets what its template
  writes (Llama 3's template writes BOS itself).
- EOS: ``with_eos`` appends the tokenizer's EOS after every string completion and
  document, once: a text that already ends with it gets no second one. A tokenizer
  whose encode also appends EOS (a post-processor ``$A EOS``) still ends each row with
  one EOS.
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
_PROBE = "a"
"""A text every tokenizer encodes to something: its ids with and without special tokens
show what the tokenizer puts before a text."""
SPECIALS = "bos-as-tokenizer,eos-once"
"""The rule of [Note: special tokens], recorded in a prepared dataset's manifest: data
prepared under another rule (or before there was one) is prepared again."""


class Tokenizer(Protocol):
    """What the data pipeline and the training loop need from a tokenizer (an optional
    ``bos_ids`` attribute: [Note: special tokens]; absent means none)."""

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


def bos_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The tokens ``tokenizer`` puts before a text ([Note: special tokens]); () for a
    tokenizer of the user's own without ``bos_ids``."""
    return tuple(getattr(tokenizer, "bos_ids", ()))


def with_bos(tokenizer: Tokenizer, ids: np.ndarray) -> np.ndarray:
    """``ids`` of a document or string prompt with the tokenizer's BOS first, unless it
    is already there ([Note: special tokens])."""
    bos = bos_ids(tokenizer)
    if not bos or (len(ids) >= len(bos) and tuple(ids[: len(bos)].tolist()) == bos):
        return ids
    return np.concatenate([np.asarray(bos, dtype=ids.dtype), ids])


def with_eos(tokenizer: Tokenizer, ids: np.ndarray) -> np.ndarray:
    """``ids`` of a completion or document with the EOS appended, unless it already ends
    with it or the tokenizer has none ([Note: special tokens])."""
    eos = tokenizer.eos_id
    if eos is None or (len(ids) and int(ids[-1]) == eos):
        return ids
    return np.concatenate([ids, np.asarray([eos], dtype=ids.dtype)])


def describe_special_tokens(tokenizer: Tokenizer, *, rows: bool, chat: bool = False) -> str:
    """What the run's first lines say about BOS and EOS ([Note: special tokens]);
    ``rows``: SFT or preference rows (else plain documents), ``chat``: some are chat."""
    bos, eos = bos_ids(tokenizer), tokenizer.eos_id
    before, after = ("string prompt", "string completion") if rows else ("document",) * 2
    if bos:
        text = f"bos: added by the tokenizer ({tokenizer.decode(list(bos))}) before each {before}"
    else:
        text = "bos: none (the tokenizer's encode adds none)"
    if eos is None:
        text += "; eos: none (the tokenizer has none"
        text += ")" if rows else ": documents are separated by a blank line)"
    else:
        text += (
            f"; eos: appended ({tokenizer.decode([eos])}) after each {after}, once (none "
            "added to one already ending with it)"
        )
    if chat:
        text += "; chat rows: as the chat template writes them (its BOS, its end of turn)"
    return text


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocab 256); decoding replaces invalid byte sequences."""

    vocab_size: int = 256
    eos_id: int | None = None
    bos_ids: tuple[int, ...] = ()

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
        return {
            "kind": "byte",
            "fingerprint": "byte-utf8",
            "vocab_size": 256,
            "eos_id": None,
            "bos_ids": [],
        }


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from a local ``tokenizer.json``.

    ``encode`` adds no special tokens; ``bos_ids`` are those the tokenizer's own encode
    puts first, added by the data pipeline where TRL's trainers get them ([Note:
    special tokens]).
    """

    def __init__(
        self, tok: Any, *, eos_id: int | None, source: Path, bos_ids: tuple[int, ...] = ()
    ) -> None:
        self._tok = tok
        self.source = source
        self.vocab_size: int = int(tok.get_vocab_size(with_added_tokens=True))
        self.eos_id: int | None = eos_id
        self.bos_ids: tuple[int, ...] = bos_ids

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
            "bos_ids": list(self.bos_ids),
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


def document_end(tokenizer: Tokenizer, *, last: int) -> list[int]:
    """What closes a document whose last token is ``last``: the EOS, unless it already
    is one; a blank line when the tokenizer has no EOS ([Note: special tokens])."""
    if tokenizer.eos_id is None:
        return separator_ids(tokenizer)
    return [] if last == tokenizer.eos_id else [tokenizer.eos_id]


def document_ids(tokenizer: Tokenizer, ids: np.ndarray) -> np.ndarray:
    """One document as a text stream holds it: the BOS (when the tokenizer adds one), its
    ids, then ``document_end``; an empty document is nothing."""
    if not len(ids):
        return np.empty(0, dtype=np.int64)
    ids = with_bos(tokenizer, ids.astype(np.int64))
    end = document_end(tokenizer, last=int(ids[-1]))
    return np.concatenate([ids, np.asarray(end, dtype=np.int64)])


def join_documents(tokenizer: BulkEncoder, docs: Sequence[str]) -> torch.Tensor:
    """Each document's ``document_ids`` (what a prepared text stream holds)."""
    parts: list[np.ndarray] = []
    for ids in tokenizer.encode_many(docs):
        parts.append(document_ids(tokenizer, ids))  # type: ignore[arg-type]
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
    config = _tokenizer_config(file.parent / "tokenizer_config.json")
    return HFTokenizer(
        tok,
        eos_id=_find_eos_id(tok, config),
        source=file,
        bos_ids=_find_bos_ids(tok),
    )


def _find_eos_id(tok: Any, config: dict[str, Any]) -> int | None:
    """The EOS id named by a sibling tokenizer_config.json, else a well-known EOS token."""
    for candidate in (_config_token(config, "eos_token"), *_EOS_CANDIDATES):
        if candidate is None:
            continue
        token_id = tok.token_to_id(candidate)
        if token_id is not None:
            return int(token_id)
    return None


def _find_bos_ids(tok: Any) -> tuple[int, ...]:
    """What the tokenizer's own encode puts before a text ([Note: special tokens]): the
    tokens its tokenizer.json post-processor adds before a probe text. (transformers 5
    drops tokenizer_config.json's ``add_bos_token`` when there is a tokenizer.json, so
    the post-processor is what ``tokenizer(text)`` adds, and what TRL's rows start with.)"""
    plain = list(tok.encode(_PROBE, add_special_tokens=False).ids)
    full = list(tok.encode(_PROBE, add_special_tokens=True).ids)
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return tuple(int(i) for i in full[:k])
    return ()


def _tokenizer_config(config_file: Path) -> dict[str, Any]:
    """tokenizer_config.json as a dict ({} when there is none or it is not readable)."""
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _config_token(config: dict[str, Any], key: str) -> str | None:
    """A special token of tokenizer_config.json (a string or {"content": ...}), if any."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
