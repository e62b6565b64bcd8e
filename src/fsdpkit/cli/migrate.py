"""``fsdpkit migrate``: turn an Accelerate or FSDP1 setup into an fsdpkit config.

    fsdpkit migrate accelerate.yaml -o run.toml        # Accelerate config (FSDP1 or FSDP2 keys)
    fsdpkit migrate --fsdp1 '{"sharding_strategy": "HYBRID_SHARD", "use_orig_params": true}'
    fsdpkit migrate --fsdp1 fsdp_args.py     # a file: JSON, a dict literal or an FSDP(...) call

The TOML has a comment beside every setting (where it came from, what changed) and
lists what has no equivalent; it is checked by loading it as `fsdpkit train` would.
Without -o it is printed. Warnings (conflicts, unknown keys) also go to stderr.
FSDP1 checkpoints need no conversion: model.init_from=DIR_OR_FILE loads them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdpkit.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "migrate",
        help="convert an Accelerate config or FSDP1 arguments to an fsdpkit config",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="Accelerate config file (YAML or JSON)")
    p.add_argument("--fsdp1", metavar="SPEC", help="FSDP1 constructor arguments, or a file of them")
    p.add_argument("-o", "--output", default=None, help="write the TOML here (default: print)")
    p.add_argument("--force", action="store_true", help="overwrite an existing -o file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fsdpkit.migrate import convert_accelerate, convert_fsdp1, render, validate

    if bool(args.config) == bool(args.fsdp1):
        raise UserError("give either an Accelerate config file or --fsdp1 SPEC (exactly one).")
    out = Path(args.output) if args.output else None
    if out is not None and out.exists() and not args.force:
        raise UserError(f"{out} exists; pass --force to overwrite it, or choose another -o.")
    name = out.name if out is not None else "run.toml"
    if args.config:
        migration = convert_accelerate(args.config, output_name=name)
    else:
        migration = convert_fsdp1(args.fsdp1)
        migration.launch = f"fsdpkit train {name} --nproc N"
    text = render(migration)
    validate(text, origin=migration.origin)
    for warning in migration.warnings:
        print(f"fsdpkit migrate: warning: {warning}", file=sys.stderr)
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        print(
            f"fsdpkit migrate: wrote {out} ({len(migration.settings)} settings, "
            f"{len(migration.dropped)} without equivalent)",
            file=sys.stderr,
        )
    return 0
