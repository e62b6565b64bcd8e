"""``fsdpkit ckpt``: look into, check and convert checkpoints (offline, one process).

fsdpkit ckpt list runs/default
fsdpkit ckpt inspect runs/default/checkpoints/step-00000300 [--json]
fsdpkit ckpt verify runs/default/checkpoints/step-00000300      # exit 1 if corrupt
fsdpkit ckpt export runs/default/checkpoints/step-00000300 --format hf out/ [--dtype bf16]
fsdpkit ckpt export CKPT --format peft adapter/      # LoRA adapters, for PeftModel
fsdpkit ckpt export CKPT --merge --format hf merged/ # LoRA folded into the base
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fsdpkit.errors import UserError


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _writer(info: dict[str, Any]) -> str:
    """Which fsdpkit and torch wrote it; checkpoints from before fsdpkit 0.1.0's release
    did not record it (docs/compatibility.md says what this release does with them)."""
    fmt = f"format {info['format_version']}"
    if not info.get("fsdpkit_version"):
        return f"an fsdpkit older than 0.1.0 (no version recorded), {fmt}"
    return f"fsdpkit {info['fsdpkit_version']} (torch {info['torch_version']}), {fmt}"


def _inspect(args: argparse.Namespace) -> int:
    from fsdpkit.checkpoint import inspect_checkpoint

    info = inspect_checkpoint(Path(args.path))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"checkpoint   {info['path']}")
    print(f"step         {info['step']}  (saved {info['time']})")
    print(f"written by   {_writer(info)}")
    print(f"world size   {info['world_size']}  mesh {info['mesh']}  strategy {info['strategy']}")
    print(f"tensors      {info['tensors']}  (+{info['objects']} non-tensor objects)")
    print(f"bytes        {_mb(info['tensor_bytes'])} of tensors, {_mb(info['file_bytes'])} on disk")
    for dtype, n in sorted(info["bytes_by_dtype"].items()):
        print(f"  {dtype:<10} {_mb(n)}")
    for section, n in sorted(info["bytes_by_section"].items()):
        print(f"  {section:<10} {_mb(n)}")
    print("largest tensors:")
    for t in info["largest"]:
        print(f"  {_mb(t['bytes']):>12}  {t['dtype']:<9} {t['shape']!s:<16} {t['name']}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; pass a checkpoint directory.")
    from fsdpkit.checkpoint import verify

    report = verify(path, metadata=True)
    print(report.describe())
    for problem in report.problems:
        print(f"  - {problem}", file=sys.stderr)
    return 0 if report.ok else 1


def _list(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist; pass logging.run_dir.")
    from fsdpkit.checkpoint import list_run

    rows = list_run(run_dir)
    if not rows:
        print(f"no checkpoints in {run_dir}")
        return 0
    print(f"{'step':>10}  {'time':<25}  {'size':>12}  status")
    for row in rows:
        size = _mb(row["bytes"]) if row["bytes"] is not None else "?"
        print(f"{row['step']:>10}  {row['time'] or '-':<25}  {size:>12}  {_STATUS[row['state']]}")
    for row in rows:
        if row["state"] == "unreadable":
            print(f"{row['path']}: {row['problem']}", file=sys.stderr)
    return 0


_STATUS = {"complete": "complete", "incomplete": "partial", "unreadable": "unreadable marker"}
"""``partial``: incomplete (a save in progress or cut short; never resumed from)."""


def _export(args: argparse.Namespace) -> int:
    from fsdpkit.checkpoint import read_meta
    from fsdpkit.export import export

    read_meta(Path(args.ckpt))  # a clear error first if it is not a checkpoint
    out = export(args.ckpt, args.out, fmt=args.format, dtype=args.dtype, merge=args.merge)
    how = f"{args.format}, adapters merged" if args.merge else args.format
    print(f"exported {args.ckpt} -> {out} ({how})")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "ckpt", help="inspect, verify, list and export checkpoints", description=__doc__
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    p = sub.add_parser("inspect", help="step, world size, tensors and bytes of a checkpoint")
    p.add_argument("path", help="checkpoint directory (step-NNNNNNNN)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("verify", help="recompute checksums; exit 1 if anything is damaged")
    p.add_argument("path", help="checkpoint directory (step-NNNNNNNN)")
    p.set_defaults(func=_verify)
    p = sub.add_parser(
        "list", help="checkpoints of a run: step, time, size, complete/partial/unreadable"
    )
    p.add_argument("run_dir", help="run directory (logging.run_dir)")
    p.set_defaults(func=_list)
    p = sub.add_parser(
        "export", help="write model weights as HF safetensors, a peft adapter dir or a torch file"
    )
    p.add_argument("ckpt", help="checkpoint directory (step-NNNNNNNN)")
    p.add_argument(
        "--format",
        choices=["hf", "peft", "torch"],
        default="hf",
        help="output format (peft: LoRA adapters for PeftModel.from_pretrained)",
    )
    p.add_argument(
        "--merge", action="store_true", help="fold LoRA adapters into the base (--format hf)"
    )
    p.add_argument("out", help="output directory (hf, peft) or file (torch)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="cast weights")
    p.set_defaults(func=_export)
