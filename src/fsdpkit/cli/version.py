"""``fsdpkit version``: the fsdpkit version and what it runs on, for bug reports.

fsdpkit version            # one line per library
fsdpkit version --json     # the same as JSON
fsdpkit --version          # just fsdpkit's version
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fsdpkit.version import version_info


def _version(args: argparse.Namespace) -> int:
    info = version_info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for name, value in info.items():
        print(f"{name:<15} {'-' if value is None else value}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "version", help="fsdpkit, torch, CUDA/NCCL, transformers and peft versions"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=_version)
