"""The tokenizer of a prepared dataset, and the check that a run uses the same one.

A dataset's manifest records its tokenizer's fingerprint (fsdpkit.data.tokenizer);
token ids mean nothing under another vocabulary, so a run whose ``data.tokenizer`` (or
``model.hf``'s tokenizer) differs is refused, naming both. With ``data.tokenizer``
empty a run uses the dataset's own copy (``DIR/tokenizer``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdpkit.config import DataConfig
from fsdpkit.data.errors import DataError
from fsdpkit.data.manifest import TOKENIZER_DIR, Manifest, is_dataset
from fsdpkit.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer


def _describe(fp: dict[str, Any]) -> str:
    if fp.get("kind") == "byte":
        return "the byte-level tokenizer (vocab 256)"
    digest = str(fp.get("fingerprint", "?"))[:19]
    return f"{fp.get('path', '?')} ({digest}..., vocab {fp.get('vocab_size')})"


def mismatch(root: Path, manifest: Manifest, *, given: dict[str, Any], named: str) -> str | None:
    """Why the tokenizer ``given`` (from ``named``) cannot train ``root``, or None."""
    if given.get("fingerprint") == manifest.tokenizer.get("fingerprint"):
        return None
    return (
        f"the dataset {root} was tokenized with {_describe(manifest.tokenizer)}, but {named} "
        f"is {_describe(given)}: its token ids would mean other words. Prepare the data "
        "again with this tokenizer (fsdpkit data prepare ... --tokenizer DIR), or train "
        "with the dataset's tokenizer (leave data.tokenizer empty, or point it at "
        f"{root / TOKENIZER_DIR})."
    )


def check_tokenizer(manifest: Manifest, tokenizer_dir: str | Path | None, *, root: Path) -> None:
    """Raise a DataError naming both when ``tokenizer_dir`` (None: byte-level) is not the
    tokenizer the dataset at ``root`` was prepared with (planner, doctor, training)."""
    cfg = DataConfig(tokenizer=str(tokenizer_dir) if tokenizer_dir else None)
    tok = build_tokenizer(cfg)
    given = tok.fingerprint()  # type: ignore[attr-defined]
    why = mismatch(root, manifest, given=given, named=f"the tokenizer {tokenizer_dir or '(byte)'}")
    if why:
        raise DataError(why)


def dataset_tokenizer(cfg: DataConfig, manifest: Manifest, *, root: Path) -> Tokenizer:
    """The tokenizer to train ``root`` with: data.tokenizer when set (checked), else the
    dataset's own."""
    if cfg.tokenizer:
        tok = build_tokenizer(cfg)
        given = tok.fingerprint()  # type: ignore[attr-defined]
        why = mismatch(root, manifest, given=given, named=f"data.tokenizer ({cfg.tokenizer})")
        if why:
            raise DataError(why)
        return tok
    if manifest.tokenizer.get("kind") == "byte":
        return ByteTokenizer()
    own = root / TOKENIZER_DIR
    if not (own / "tokenizer.json").is_file():
        raise DataError(
            f"the dataset {root} was tokenized with {_describe(manifest.tokenizer)} and holds "
            "no copy of it; set data.tokenizer to that tokenizer's directory."
        )
    tok = build_tokenizer(DataConfig(tokenizer=str(own)))
    why = mismatch(root, manifest, given=tok.fingerprint(), named=str(own))  # type: ignore[attr-defined]
    if why:
        raise DataError(why)
    return tok


def run_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer a run of ``cfg`` trains with, without preparing anything: the
    dataset's when ``data.path`` is a prepared dataset (checked against data.tokenizer
    when that is set), else ``data.tokenizer``'s (byte-level when empty). The planner and
    the doctor use it for the vocabulary."""
    if cfg.path and is_dataset(Path(cfg.path).expanduser()):
        root = Path(cfg.path).expanduser()
        return dataset_tokenizer(cfg, Manifest.read(root), root=root)
    return build_tokenizer(cfg)
