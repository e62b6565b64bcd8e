"""Data checks for a run config: a prepared ``data.path`` (or ``data.mix`` source) is
whole and was made with the tokenizer the run will use; raw sources are named as such.

Pure over what ``fsdpkit.data.inspect_dataset`` reads (the manifest, shard files and
their crc32s), so a damaged dataset or a tokenizer mismatch shows up before a launch.
"""

from __future__ import annotations

from pathlib import Path

from fsdpkit.config import RunConfig
from fsdpkit.data import DataError, check_tokenizer, inspect_dataset, is_dataset, parse_mix
from fsdpkit.doctor.check import Check, fail, ok, warn
from fsdpkit.models.hf.directory import with_model_tokenizer


def _paths(cfg: RunConfig) -> list[Path]:
    """The sources a run reads: data.path, or each data.mix entry (PATH@WEIGHT)."""
    if cfg.data.mix:
        return [Path(path).expanduser() for path, _ in parse_mix(cfg.data.mix)]
    return [Path(cfg.data.path).expanduser()] if cfg.data.path else []


def dataset_checks(cfg: RunConfig) -> list[Check]:
    """One check per source: a prepared dataset's integrity and tokenizer, or a note
    that raw sources are prepared at the start of the run."""
    tokenizer = with_model_tokenizer(cfg).data.tokenizer
    checks = [_dataset_check(path, tokenizer=tokenizer) for path in _paths(cfg)]
    return checks or [ok("data", "the built-in corpus (prepared into the run directory at start)")]


def _dataset_check(path: Path, *, tokenizer: str | None) -> Check:
    name = f"data {path.name or path}"
    if not is_dataset(path):
        return ok(
            name,
            f"{path}: raw sources, tokenized into data.cache_dir (default RUN_DIR/data) "
            "at the start of the run, once",
            "for large corpora prepare once: fsdpkit data prepare SRC -o DIR, then data.path=DIR",
        )
    info = inspect_dataset(path, verify=True, sources=True)
    if not info.ok or info.manifest is None:
        return fail(
            name,
            f"{path} is damaged: " + "; ".join(info.problems[:4]),
            "prepare it again (fsdpkit data prepare ... -o DIR); a run refuses it",
        )
    try:  # no tokenizer configured: the run takes the dataset's own
        if tokenizer is not None:
            check_tokenizer(info.manifest, tokenizer, root=path)
    except DataError as exc:
        return fail(name, str(exc), "use the tokenizer the dataset was prepared with")
    counts = info.manifest.counts
    summary = f"{path}: {counts['documents']:,} documents, {counts['tokens']:,} tokens, intact"
    if info.warnings:
        return warn(name, f"{summary}; " + "; ".join(info.warnings[:3]))
    return ok(name, summary)
