"""``fsdpkit data``: tokenize sources once into a dataset, and look into one.

    fsdpkit data prepare corpus/ -o data/corpus                   # byte-level tokenizer
    fsdpkit data prepare train.jsonl extra/*.parquet -o data/sft --tokenizer models/llama
    fsdpkit data prepare hf-repo/ -o data/x --format sft --schema sharegpt --workers 8
    fsdpkit data inspect data/corpus [--verify] [--json]          # exit 1 if damaged

then ``fsdpkit train data.path=data/corpus``. Sources: text files, directories, globs,
.jsonl (.gz/.zst), .json, .parquet, Arrow directories from datasets.save_to_disk, local
HF dataset repositories (train split). Rerunning on unchanged sources does nothing; a
changed source or tokenizer is refused unless --rebuild. See docs/data.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the library is imported by the command run, not by `fsdpkit --help`
    from fsdpkit.config import DataConfig


def _config(args: argparse.Namespace) -> DataConfig:
    from fsdpkit.config import DataConfig

    tokenizer = None if args.tokenizer in (None, "byte") else args.tokenizer
    columns = [c for item in args.columns for c in item.split(",") if c]
    return dataclasses.replace(
        DataConfig(),
        tokenizer=tokenizer,
        format=args.format,
        schema=args.schema,
        columns=columns,
        text_field=args.text_field,
        workers=args.workers,
        allow_binary=args.allow_binary,
        max_bytes=args.max_bytes,
    )


def _prepare(args: argparse.Namespace) -> int:
    from fsdpkit.data import prepare
    from fsdpkit.data.sft import describe_schemas

    out = Path(args.out)
    done = prepare(_config(args), out, paths=list(args.sources), rebuild=args.rebuild)
    m, c = done.manifest, done.manifest.counts
    if done.reused:
        print(f"{out} is up to date (same sources, tokenizer and options): nothing to do")
    kind = f"SFT data: {describe_schemas(m.schemas)}" if m.sft else "plain text"
    print(
        f"{kind}: {c['source_files']:,} file(s), {c['source_bytes'] / 1e6:,.1f} MB -> "
        f"{c['documents']:,} {'examples' if m.sft else 'documents'}, {c['tokens']:,} tokens "
        f"({m.dtype}, {len(m.shards)} shard(s))"
        + (f", {c['answer_tokens']:,} answer tokens" if m.sft else "")
    )
    if not done.reused:
        mbs = c["source_bytes"] / 1e6 / max(done.seconds, 1e-9)
        print(f"prepared {out} in {done.seconds:.1f}s ({mbs:,.1f} MB/s)")
    if c.get("left_out_bytes"):
        print(f"--max-bytes left out {c['left_out_bytes']:,} source bytes")
    for note in done.plan_notes:
        print(f"left out (not data): {note}")
    print(f"train on it: fsdpkit train data.path={out}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from fsdpkit.data import inspect_dataset

    info = inspect_dataset(Path(args.path), verify=args.verify, sources=True)
    if args.json:
        print(json.dumps(info.summary(), indent=2))
    else:
        for line in info.describe():
            print(line)
    for problem in info.problems:
        print(f"  - {problem}", file=sys.stderr)
    for warning in info.warnings:
        print(f"  note: {warning}", file=sys.stderr)
    return 0 if info.ok else 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "data", help="prepare datasets (tokenize once) and inspect them", description=__doc__
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    p = sub.add_parser("prepare", help="tokenize sources into memory-mapped shards + manifest")
    p.add_argument("sources", nargs="+", metavar="SRC", help="files, directories or globs")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="the dataset directory")
    p.add_argument(
        "--tokenizer", default=None, metavar="DIR|byte", help="tokenizer.json or its folder"
    )
    p.add_argument("--format", choices=["auto", "text", "sft"], default="auto")
    p.add_argument(
        "--schema",
        choices=["auto", "messages", "sharegpt", "prompt_completion", "alpaca", "text"],
        default="auto",
        help="SFT record schema (auto: detected per record)",
    )
    p.add_argument(
        "--columns", action="append", default=[], metavar="KEY=COLUMN", help="rename columns"
    )
    p.add_argument("--text-field", default="text", help="field holding the text of text records")
    p.add_argument("--workers", type=int, default=0, help="processes (0: one per core)")
    p.add_argument("--max-bytes", type=int, default=None, help="read at most this many bytes")
    p.add_argument("--allow-binary", action="store_true", help="accept files that look binary")
    p.add_argument("--rebuild", action="store_true", help="replace DIR if its inputs changed")
    p.set_defaults(func=_prepare)
    p = sub.add_parser("inspect", help="counts, tokenizer, sources and problems of a dataset")
    p.add_argument("path", help="a dataset directory (fsdpkit data prepare -o DIR)")
    p.add_argument("--verify", action="store_true", help="recompute every shard's crc32")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect)
