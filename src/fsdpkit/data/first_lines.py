"""What a run prints first about its data: sources, schema, counts, split, what was left out.

Nothing is cut or skipped silently: a ``data.max_bytes`` that stopped reading, the other
splits of a dataset repository, the token-tail validation of a one-document corpus and
truncated or dropped SFT examples are all named here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsdpkit.data.manifest import Manifest
from fsdpkit.data.opened import Opened
from fsdpkit.data.sft import describe_schemas
from fsdpkit.data.tokenizer import SPECIALS, Tokenizer, describe_special_tokens


def tokenizer_name(manifest: Manifest) -> str:
    tok = manifest.tokenizer
    if tok.get("kind") == "byte":
        return "byte-level tokenizer"
    return f"tokenizer {tok.get('path')} (vocab {tok.get('vocab_size'):,})"


def source_line(opened: Opened) -> str:
    """``data: SRC -> DIR: ...`` (what was read, with what, into what)."""
    cfg, m = opened.cfg, opened.dataset.manifest
    c = m.counts
    what = f"data.path ({cfg.path})" if cfg.path else "the built-in corpus (Python stdlib)"
    if opened.prepared is None:
        how = f"prepared dataset, made {m.created} by fsdpkit {m.fsdpkit_version}"
    elif opened.prepared.reused:
        how = f"prepared earlier into {opened.dataset.root}"
    else:
        how = f"prepared into {opened.dataset.root} in {opened.prepared.seconds:.1f}s"
    body = (
        f"{c['source_files']:,} file(s), {c['source_bytes'] / 1e6:,.1f} MB -> "
        f"{c['documents']:,} {'examples' if m.sft else 'documents'}, {c['tokens']:,} tokens"
    )
    kind = f"SFT: {describe_schemas(m.schemas)}" if m.sft else "plain text"
    empty = c.get("empty_replies", 0)
    if empty:
        kind += f"; {empty:,} empty assistant repl{'y' if empty == 1 else 'ies'} not trained"
    return f"data: {what}: {kind}; {body} ({tokenizer_name(m)}, {m.dtype}; {how})"


def special_tokens_line(opened: Opened, tokenizer: Tokenizer) -> str:
    """``data: bos: ...; eos: ...`` ([Note: special tokens]) as the dataset was prepared."""
    m = opened.dataset.manifest
    if m.tokenizer.get("specials") != SPECIALS:
        return (
            "data: bos/eos: as the fsdpkit that prepared this dataset added them (no BOS; an "
            "EOS after every completion and document, even one already ending with it). "
            "Prepare it again for the tokenizer's own BOS and one EOS."
        )
    chat = m.sft and m.tokenizer.get("chat_template") is not None
    return "data: " + describe_special_tokens(tokenizer, rows=m.sft, chat=chat)


def left_out_lines(opened: Opened) -> list[str]:
    cfg, c = opened.cfg, opened.dataset.manifest.counts
    out = []
    if c.get("left_out_bytes"):
        cap = opened.dataset.manifest.options.get("max_bytes")
        total = c["source_bytes"] + c["left_out_bytes"]
        whole = f", {c['left_out_files']:,} whole file(s)" if c.get("left_out_files") else ""
        out.append(
            f"data: data.max_bytes = {cap:,} stopped reading: {c['source_bytes']:,} of "
            f"{total:,} source bytes used, {c['left_out_bytes']:,} left out{whole}. Remove "
            "data.max_bytes to train on all of it."
        )
    if opened.prepared is None and cfg.max_bytes is not None:
        out.append(
            f"data: data.max_bytes = {cfg.max_bytes:,} has no effect on a prepared dataset "
            "(it applies when sources are prepared)."
        )
    notes = opened.prepared.plan_notes if opened.prepared else ()
    out += [f"data: left out (not data): {n}" for n in notes]
    return out


def split_line(opened: Opened, loader: Any) -> str:
    ds, cfg, split = opened.dataset, opened.cfg, opened.split
    if opened.sft:
        train, held = opened.train, opened.val
        text = f"data: SFT rows: {train.stats.describe(seq_len=cfg.seq_len, packed=cfg.pack)}"
        if held is not None:
            text += f"; validation: the last {split.val_docs:,} examples ({len(held):,} rows)"
        return text
    val_tokens = len(ds.tokens) - split.train_end
    if split.by_tokens:
        val = (
            f"validation: the last {val_tokens:,} tokens (the corpus has {ds.documents} "
            f"document(s), too few to hold out whole ones at data.val_fraction {cfg.val_fraction})"
        )
    elif split.val_docs:
        val = f"validation: the last {split.val_docs:,} documents ({val_tokens:,} tokens)"
    else:
        val = "no validation split (data.val_fraction = 0)"
    return (
        f"data: training on {split.train_end:,} tokens = {loader.num_sequences:,} sequences of "
        f"{cfg.seq_len}; {val}"
    )


def epochs_line(loader: Any, *, steps: int | None, epochs: Callable[[int], float]) -> str:
    text = (
        f"data: {loader.steps_per_epoch:,} optimizer steps per epoch of "
        f"{loader.step_sequences:,} sequences (each epoch reshuffled)"
    )
    if steps:
        text += f"; this run's {steps:,} steps cover {epochs(steps):.2f} epoch(s)"
    return text


def describe_run(
    opened: Opened,
    *,
    tokenizer: Tokenizer,
    loader: Any,
    steps: int | None,
    epochs: Callable[[int], float],
) -> str:
    """The data lines a run prints first."""
    lines = [source_line(opened), special_tokens_line(opened, tokenizer)]
    lines.append(split_line(opened, loader))
    lines.append(epochs_line(loader, steps=steps, epochs=epochs))
    lines += left_out_lines(opened)
    return "\n".join(lines)
