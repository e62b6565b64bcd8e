"""The ``fsdpkit`` command: wires the subcommand modules of this package.

Each module ``fsdpkit.cli.<name>`` that defines ``register(subparsers)`` is a
subcommand; ``register`` adds its parser and sets ``func`` (args -> exit code).
Errors that are the user's (bad config, missing files) print one paragraph and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from fsdpkit.errors import UserError
from fsdpkit.version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdpkit", description="Correct, fast FSDP2 training for models that don't fit."
    )
    parser.add_argument("--version", action="version", version=f"fsdpkit {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"fsdpkit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a run started (a run handles its own)
        print(f"fsdpkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
