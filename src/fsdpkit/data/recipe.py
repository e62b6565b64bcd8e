"""What decides a prepared dataset's tokens, and what changed since one was prepared.

``recipe`` is everything besides the sources that the tokens depend on: the data kind,
the tokenizer's fingerprint (with its chat template and the rule for BOS and EOS,
[Note: special tokens]) and the options that change tokens. ``differences`` compares
an existing manifest with these and the sources' sizes, mtimes and hashes: step 2 of
[Note: prepare protocol] (fsdpkit.data.prepare).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from fsdpkit.config import DataConfig
from fsdpkit.data.chat import template_hash
from fsdpkit.data.errors import DataError
from fsdpkit.data.manifest import Manifest
from fsdpkit.data.plan import data_kind
from fsdpkit.data.sources import Resolved
from fsdpkit.data.tokenizer import SPECIALS, BulkEncoder, build_tokenizer


def recipe(cfg: DataConfig, resolved: Resolved) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(kind, tokenizer fingerprint, options): what decides the tokens besides the sources."""
    kind = data_kind(cfg, resolved)
    tok = build_tokenizer(cfg)
    if not isinstance(tok, BulkEncoder):
        raise DataError("prepare needs the byte tokenizer or a tokenizer.json (data.tokenizer).")
    fingerprint = tok.fingerprint()
    fingerprint["chat_template"] = template_hash(cfg.tokenizer) if kind == "sft" else None
    fingerprint["specials"] = SPECIALS
    options = {
        "text_field": cfg.text_field,
        "schema": cfg.schema,
        "columns": list(cfg.columns),
        "allow_binary": cfg.allow_binary,
        "max_bytes": cfg.max_bytes,
    }
    return kind, fingerprint, options


def source_stats(resolved: Resolved) -> list[dict[str, Any]]:
    """Each source's path, size and mtime: what says cheaply that it has not changed."""
    stats = [(s.path, s.path.stat()) for s in resolved.sources]
    return [
        {"path": str(p.resolve()), "size": t.st_size, "mtime_ns": t.st_mtime_ns} for p, t in stats
    ]


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def differences(
    old: Manifest, *, kind: str, tokenizer: dict, options: dict, sources: list
) -> list[str]:
    """What makes ``old`` not the dataset these inputs would give (empty: the same)."""
    out = _tokenizer_changes(old.tokenizer, tokenizer)
    if old.kind != kind:
        out.append(f"the data kind ({old.kind} -> {kind})")
    changed = [k for k in options if old.options.get(k) != options[k]]
    out += [f"data.{k} ({old.options.get(k)!r} -> {options[k]!r})" for k in changed]
    before = {s["path"]: s for s in old.sources}
    now = {s["path"] for s in sources}
    out += [f"{p} is no longer a source" for p in sorted(set(before) - now)]
    for s in sources:
        was = before.get(s["path"])
        if was is None:
            out.append(f"{s['path']} is a new source")
        elif was["size"] != s["size"]:
            out.append(f"{s['path']} changed size ({was['size']:,} -> {s['size']:,} bytes)")
        elif was["mtime_ns"] != s["mtime_ns"] and was.get("sha256") != sha256_file(Path(s["path"])):
            out.append(f"{s['path']} changed (sha256)")
    return out


def _tokenizer_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs in how the tokens are made: the tokenizer, its chat template, the
    rule for BOS and EOS ([Note: special tokens])."""
    out = []
    if old.get("fingerprint") != new["fingerprint"]:
        out.append(
            f"the tokenizer ({old.get('path', old.get('kind'))} -> {new.get('path', new['kind'])})"
        )
    elif old.get("chat_template") != new.get("chat_template"):
        out.append("the tokenizer's chat template")
    if any(old.get(k) != new.get(k) for k in ("specials", "bos_ids")):
        out.append("how BOS and EOS are added ([Note: special tokens] in fsdpkit.data.tokenizer)")
    return out
